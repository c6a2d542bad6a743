"""`cisjax plan`: ahead-of-time compilation of the train step for TPU slices and GPU sets on a CPU host."""
