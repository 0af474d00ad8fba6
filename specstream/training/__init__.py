"""Training a draft head for a target (`specstream train-draft`)."""
