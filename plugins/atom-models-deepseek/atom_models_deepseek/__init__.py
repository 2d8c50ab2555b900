"""DeepSeek-V2/V3 (MLA attention, mixture-of-experts) for ATOM."""
