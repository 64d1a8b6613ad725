"""The model: loading it, what it computes, and how it runs in little memory:

    tiny.py         the built-in tiny models and the synthetic preference data (python -m lowmem_dpo.model.tiny)
    models.py       model and tokenizer loading, quantized bases, which model a recipe names (model_source)
    adapters.py     the SFT adapter as reference and policy: continue it, or merge it and add a fresh one
    logps.py        completion log-probs, chunked over tokens, and each architecture's LM head (HEADS): pure
    activations.py  long sequences: the MLP in tiles, activations offloaded to host memory
    sdpa.py         which attention kernel SDPA runs (torch's dispatcher), the attention calls a forward makes
    packing.py      padding_free: a micro-batch's sequences in one row, each attending to itself (SDPA per sequence)
    streaming.py    decoder layers streamed from pinned CPU RAM (the planner's last knob)
    headcheck.py    the stages' first-batch checks: an unknown LM head against the model's own forward, whether
                    the prompt can be shared, which attention kernel runs
    weights.py      a model folder's safetensors, read and written a block of rows at a time
    lora_merge.py   a saved LoRA adapter merged as peft's merge_and_unload does: W + scale * B @ A

Its face: models.load_model / load_tokenizer / model_source, logps.completion_logps.
"""
