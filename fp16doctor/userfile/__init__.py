"""The user's training file: loading it (:mod:`.spec`), its batches (:mod:`.batches`) and the canonical AMP loop (:mod:`.loop`)."""
