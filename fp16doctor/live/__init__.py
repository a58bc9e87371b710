"""Inside a user's running training: the live watch, its replay capsules, the trainers' callbacks, and what
``fp16doctor watch`` runs a script with (``script``: run as python would; ``observe``: every optimizer step
observed from outside)."""
