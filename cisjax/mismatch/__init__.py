"""Mismatch observatory: statistics of the training-inference mismatch (paper Appendix A)."""
