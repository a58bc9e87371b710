"""Inside a user's running training: the live watch, its replay capsules, and the trainers' callbacks."""
