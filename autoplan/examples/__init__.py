"""Small programs a newcomer runs to try autoplan (`python -m autoplan.examples.<name>`).

    tiny_hf   write a tiny Llama as a local Hugging Face checkpoint (no download), to plan and
              fine-tune with `autoplan.train --hf-model`
"""
