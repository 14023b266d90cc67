"""Decontamination: the eval sets' n-grams removed from (or flagged in) the training corpus."""
