"""The vLLM engine: an in-process `vllm.LLM` over token ids, its platform choices, results and routing capture."""
