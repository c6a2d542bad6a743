"""`cisjax eval`: greedy pass@1 (and avg@K / pass@K) on GSM8K, MATH-500, SVAMP, Minerva Math and OlympiadBench."""
