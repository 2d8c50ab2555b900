"""MiniMax-M2 (MiniMaxM2ForCausalLM) for ATOM."""
