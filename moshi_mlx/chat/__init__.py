"""Full-duplex speech chat: Moshi, PersonaPlex and Hibiki (the model API, its step loop and
PersonaPlex's prompts)."""
