# One-command set-up: `make install` builds .venv; `make test` runs the suite; `make serve` runs the service.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
SHARED ?= ../shared
CACHE  := .cache
FNP_WHEEL := $(CACHE)/wheels/facenet_pytorch-2.6.0-py3-none-any.whl
REF_MODEL := $(CACHE)/models/mobilefacenet_casia

.PHONY: install test lint serve models bench clean

$(BIN)/sphereface: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e '.[cpu,train,dev]'
	@$(BIN)/python -c "import torch; assert torch.__version__.startswith('2.13.0'), torch.__version__"
	@touch $@

$(FNP_WHEEL):
	mkdir -p $(CACHE)/wheels
	$(BIN)/pip download -q --no-deps facenet-pytorch==2.6.0 -d $(CACHE)/wheels

install: $(BIN)/sphereface $(FNP_WHEEL)

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

serve: install models
	$(BIN)/sphereface serve --model $(REF_MODEL)

bench: install models
	$(BIN)/python bench/face_path.py --model $(REF_MODEL)

clean:
	rm -rf $(VENV) $(CACHE) *.egg-info
