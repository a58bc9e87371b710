"""The probe engine: short trainings of the user's training in one precision mode, their instruments and RNG."""
