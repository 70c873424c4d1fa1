"""Layer 4, generic speculative decoding: target runner (target.py), verification (verify.py),
decoding loops (generate.py), CUDA graphs (compile.py), the validate and export stages. Talks to a
head only through heads/drafting.py and the registry; never imports train/."""
