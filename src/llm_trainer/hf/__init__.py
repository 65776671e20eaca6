"""Hugging Face `transformers` interop: export our models as GPT2LMHeadModel / LlamaForCausalLM
folders, and import theirs (for model.init_from)."""
