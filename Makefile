# Entry points for a fresh machine; each creates .venv and installs what it needs.
#   make demo   plan GPT-3 175B on 1024 H100s and show the plan (writes plan.json)
#   make test   run the test suite
#   make finetune-demo   write a tiny local Hugging Face Llama, plan it for 4 CPU ranks and fine-tune it
#                        under torchrun (gloo), writing the fine-tuned checkpoint to tiny-llama-tuned/
# torch is pinned at install time (a CPU wheel here); the project itself only asks for a range,
# so pip never resolves an unpinned torch (which would pull gigabytes of CUDA packages).

PYTHON ?= python3
VENV   ?= .venv
TORCH  ?= torch==2.13.0
# triton (about 1 GB) runs the kernel tests on CPU under TRITON_INTERPRET=1; 3.9 is needed there
# (3.6 with numpy 2.4 fails on loops over runtime ints, triton #9171).
TRITON ?= triton==3.9.0
BIN     = $(VENV)/bin
STAMP   = $(VENV)/.autoplan-installed

.PHONY: demo test finetune-demo setup clean-venv

setup: $(STAMP)

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q "$(TORCH)"
	$(BIN)/python -m pip install -q "$(TRITON)"
	$(BIN)/python -m pip install -q -e ".[dev]"
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/autoplan search --model gpt3-175b --cluster 128x8xh100 --global-batch 1536 --seq 2048 -o plan.json

test: $(STAMP)
	$(BIN)/python -m pytest -q

finetune-demo: $(STAMP)
	$(BIN)/python -m autoplan.examples.tiny_hf tiny-llama-hf
	$(BIN)/autoplan search --hf-model tiny-llama-hf --cluster 1x4xcpu --global-batch 8 --seq 64 --dtype float32 \
	    -o tiny-llama-plan.json
	$(BIN)/torchrun --nproc-per-node 4 -m autoplan.train --hf-model tiny-llama-hf --plan tiny-llama-plan.json \
	    --steps 40 --save-hf tiny-llama-tuned

clean-venv:
	rm -rf $(VENV)
