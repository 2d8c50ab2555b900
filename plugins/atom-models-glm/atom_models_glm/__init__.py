"""GLM-4.5 / GLM-4.6 models (Glm4MoeForCausalLM) for ATOM."""
