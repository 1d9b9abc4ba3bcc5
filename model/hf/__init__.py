"""Hugging Face interop of the model, pure PyTorch: config.json <-> model.* fields and HF tensor names <-> our flat
layers, one module per family (gpt2.py: GPT2LMHeadModel; llama.py with llama_names.py: Llama, Qwen2, Qwen3 and
Mistral), dispatched by format.py. Reading and writing the files is harness/hf/'s job."""
