"""Hugging Face interop:

    interop         export our models as GPT2LMHeadModel / LlamaForCausalLM folders, import theirs
                    (for model.init_from)
    gguf            a GGUF file for llama.cpp
    fast_tokenizer  our tokenizer as a transformers PreTrainedTokenizerFast (`Tokenizer.as_transformers`)
    hub             whether the Hub can be reached, asked once (`data.dataset_name`, lm-eval tasks)

`fast_tokenizer` and `hub` import nothing of ours but `errors`, so the tokenizer and the data sources,
which sit below the rest of this package, may use them.
"""
