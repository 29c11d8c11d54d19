# One-command set-up: `make install` builds .venv; `make test` runs the suite; `make serve` runs the service.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
SHARED ?= ../shared
CACHE  := .cache
FNP_WHEEL := $(CACHE)/wheels/facenet_pytorch-2.6.0-py3-none-any.whl
REF_MODEL := $(CACHE)/models/mobilefacenet_casia

CELEBA := $(CACHE)/data/celeba_faces
LOSS_RUNS := softmax modified_softmax asoftmax_m1 asoftmax_m2 asoftmax_m3 asoftmax_m4 sphereface_plus \
	modified_softmax_finetune asoftmax_m4_finetune sphereface_plus_finetune

.PHONY: install test lint serve models bench bench-service bench-train bench-megaface-1m megaface-local prepare-celeba \
	loss-table default-model clean

$(BIN)/sphereface: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e '.[cpu,train,dev]'
	@$(BIN)/python -c "import torch; assert torch.__version__.startswith('2.13.0'), torch.__version__"
	@touch $@

$(FNP_WHEEL):
	mkdir -p $(CACHE)/wheels
	$(BIN)/pip download -q --no-deps facenet-pytorch==2.6.0 -d $(CACHE)/wheels

# The gallery's Redis: Debian's redis-server when none is on PATH (sudo only when not root).
.PHONY: redis-server
redis-server:
	@command -v redis-server >/dev/null 2>&1 || { \
		SUDO=; if [ "$$(id -u)" != 0 ] && command -v sudo >/dev/null 2>&1; then SUDO=sudo; fi; \
		echo "redis-server not on PATH: installing it with apt-get"; \
		$$SUDO apt-get update -qq && $$SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq redis-server; \
	}

install: $(BIN)/sphereface $(FNP_WHEEL) redis-server

# The reference MobileFaceNet (from ../shared/data) as an ONNX model folder, with its cosine
# thresholds calibrated on LFW through our own detector (a few minutes, once).
$(REF_MODEL)/model.onnx: | install
	$(BIN)/sphereface import mobilefacenet $(SHARED)/data/reference_models/mobilefacenet_casia/068.ckpt --out $(REF_MODEL)

$(REF_MODEL)/lfw_detect.json: $(REF_MODEL)/model.onnx
	$(BIN)/sphereface evaluate lfw --model $(REF_MODEL) --data $(SHARED)/data/lfw --landmarks detect \
		--write-thresholds --json $@.partial --plot $(REF_MODEL)/lfw_detect.png
	mv $@.partial $@

models: $(REF_MODEL)/lfw_detect.json

lint: install
	$(BIN)/ruff check models training service tests bench

test: install
	$(BIN)/ruff check models training service tests bench
	$(BIN)/python -m pytest -q

# The service on the default model that ships in models/default (trained by this project).
serve: install
	$(BIN)/sphereface serve

# Training data: celeba_faces detected and aligned once into packed crops (about 1 minute).
$(CELEBA)/manifest.json: | install
	$(BIN)/sphereface prepare $(SHARED)/data/celeba_faces --out $(CELEBA)

prepare-celeba: $(CELEBA)/manifest.json

# The loss comparison of docs/training.md: 7 SphereFace-4 runs of 300 steps and 3 fine-tunes of
# 150 steps (about 7 and 4 minutes each on 2 cores), then the table.
loss-table: prepare-celeba
	for run in $(LOSS_RUNS); do \
		test -f runs/celeba/sf4_$$run/summary.json || \
		$(BIN)/sphereface train training/configs/celeba/sf4_$$run.toml --no-progress || exit 1; \
	done
	$(BIN)/python -m training.loss_table $(addprefix runs/celeba/sf4_,$(LOSS_RUNS)) \
		--json docs/results/loss_table.json --markdown docs/results/loss_table.md

# Re-train the default model (about 30 minutes on 2 cores) and export it into models/default.
default-model: prepare-celeba
	$(BIN)/sphereface train training/configs/celeba/default_mobilefacenet.toml
	$(BIN)/sphereface export runs/celeba/default_mobilefacenet_m4 --out models/default \
		--name sphereface_mobilefacenet_celeba --version 1 --lfw $(SHARED)/data/lfw

# Training throughput, our loaders against a PIL-decoding DataLoader (on a GPU when there is one).
bench-train: prepare-celeba
	$(BIN)/python bench/train_loader.py --data $(CELEBA)

# The MegaFace protocol, local-v1, for the reference and the default model: JSON, plots and the
# side-by-side table in docs/results/megaface/ (about 5 minutes per model on 2 cores; cached).
MEGAFACE := docs/results/megaface
megaface-local: models
	$(BIN)/sphereface evaluate megaface --model $(REF_MODEL) --protocol local --data $(SHARED)/data \
		--json $(MEGAFACE)/local_reference.json --plots $(MEGAFACE)/reference
	$(BIN)/sphereface evaluate megaface --model models/default --protocol local --data $(SHARED)/data \
		--json $(MEGAFACE)/local_default.json --plots $(MEGAFACE)/default
	$(BIN)/sphereface report $(MEGAFACE)/local_reference.json $(MEGAFACE)/local_default.json \
		--names "reference MobileFaceNet (CASIA-WebFace),default model (celeba_faces)" --out $(MEGAFACE)/local_v1.md

# 1,000,000 distractors on this machine: time and peak memory (docs/megaface.md).
bench-megaface-1m: install
	$(BIN)/python bench/megaface_1m.py --model models/default --json docs/results/megaface_1m.json

bench: install models
	$(BIN)/python bench/face_path.py --model $(REF_MODEL)

# The service: /v1/verify against facenet-pytorch + PyTorch eager, search at 10k/100k/1M
# vectors (numpy and Redis Query Engine), bulk enrollment (about 15 minutes; docs/service.md).
bench-service: install models
	$(BIN)/python bench/service.py --json docs/results/bench_service.json

clean:
	rm -rf $(VENV) $(CACHE) *.egg-info
