"""The frozen target model (layer 2: imports only recipe.py and artifacts.py).

loading.py   load any HF causal LM and its tokenizer; content fingerprint; partial loading
features.py  forward hooks for hidden states, layer-id conventions, what a head kind needs
embedded.py  the embedded default: a tiny Llama + BPE tokenizer trained on stdlib source
stdlib.py    that corpus: the standard library's function source and chat-form conversations
"""
