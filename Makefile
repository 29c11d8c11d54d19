# One-command set-up: `make install` builds .venv; `make test` runs the suite; `make serve` runs the service.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
SHARED ?= ../shared
CACHE  := .cache
FNP_WHEEL := $(CACHE)/wheels/facenet_pytorch-2.6.0-py3-none-any.whl
# The Compose file format's JSON schema, from the last Python docker-compose (tests/test_deploy.py).
COMPOSE_WHEEL := $(CACHE)/wheels/docker_compose-1.29.2-py2.py3-none-any.whl
DLIB_MODEL := models/dlib_resnet_v1
REF_MODEL := $(CACHE)/models/mobilefacenet_casia

CELEBA := $(CACHE)/data/celeba_faces
CELEBA_SMALL := $(CACHE)/data/celeba_small
LOSS_CONFIGS := $(sort $(wildcard training/configs/celeba_more/sf4_*.toml))
# The SphereFace+ figure and MHE diagnostics of docs/results/loss-comparison.md: the A-Softmax m = 4 run, its
# three fine-tunings (no MHE, MHE 10, MHE 100) and SphereFace+ m = 2.
SFPLUS_RUNS := $(addprefix runs/celeba_more/,sf4_asoftmax_m4 sf4_asoftmax_m4_finetune sf4_sphereface_plus_finetune \
	sf4_sphereface_plus_mhe100_finetune sf4_sphereface_plus_m2_mhe10)
# The Caffe-backward figure of the same doc: A-Softmax m = 4 with the exact gradient and with the released
# Caffe layer's backward at half the table's lr, and the Caffe runs at the table's lr (they diverge).
CAFFE_RUNS := $(addprefix runs/celeba_more/sf4_asoftmax_m4,_lr0p0125 _caffe _caffe_seed1 _caffe_lr0p0125 \
	_caffe_lr0p0125_seed1)
# docs/results/hyperspherical-claims.md: the CIFAR-10 runs (seed 0 first, then the second seeds) and the face run.
HS_CIFAR := training/configs/hyperspherical/cifar
HS_CONFIGS := $(filter-out %_seed1.toml %/base.toml,$(sort $(wildcard $(HS_CIFAR)/*.toml))) \
	$(sort $(wildcard $(HS_CIFAR)/*_seed1.toml))
HS_FACES := $(sort $(wildcard training/configs/hyperspherical/sf4_*.toml))

.PHONY: install test lint cli-docs serve screenshots reliability image-test models torchvision-env bench bench-service bench-verify-default bench-largest-face bench-decode bench-session-options bench-detector-threads bench-hyperspherical bench-gallery-scan bench-gallery-memory bench-models int8-model bench-train bench-train-overhead bench-megaface-1m megaface-local gpu-pack gpu-check bench-video bench-unknown-clusters \
	prepare-celeba loss-table hyperspherical-table opt-table bench-opt sphereface-celeba-model default-model-results quality-results clean

$(BIN)/sphereface: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e '.[cpu,train,dev,video]'
	@$(BIN)/python -c "import torch; assert torch.__version__.startswith('2.13.0'), torch.__version__"
	@touch $@

$(FNP_WHEEL):
	mkdir -p $(CACHE)/wheels
	$(BIN)/pip download -q --no-deps facenet-pytorch==2.6.0 -d $(CACHE)/wheels

$(COMPOSE_WHEEL):
	mkdir -p $(CACHE)/wheels
	$(BIN)/pip download -q --no-deps docker-compose==1.29.2 -d $(CACHE)/wheels

# The default model: our converter downloads dlib's face-recognition ResNet (CC0) in the PyPI sdist
# face_recognition_models into .cache/wheels (about 100 MB, once) and writes model.onnx beside the
# committed manifest and card (ONNX parity-checked against PyTorch and against dlib itself).
$(DLIB_MODEL)/model.onnx: $(BIN)/sphereface
	$(BIN)/sphereface import dlib --out $(DLIB_MODEL)

# The gallery's Redis: Debian's redis-server when none is on PATH (sudo only when not root).
.PHONY: redis-server
redis-server:
	@command -v redis-server >/dev/null 2>&1 || { \
		SUDO=; if [ "$$(id -u)" != 0 ] && command -v sudo >/dev/null 2>&1; then SUDO=sudo; fi; \
		echo "redis-server not on PATH: installing it with apt-get"; \
		$$SUDO apt-get update -qq && $$SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq redis-server; \
	}

install: $(BIN)/sphereface $(FNP_WHEEL) $(COMPOSE_WHEEL) $(DLIB_MODEL)/model.onnx redis-server

# The browser the page's tests drive: Debian's chromium and chromium-driver (about 120 MB, once).
.PHONY: install-browser
install-browser:
	@{ command -v chromium >/dev/null 2>&1 && command -v chromedriver >/dev/null 2>&1; } || { \
		SUDO=; if [ "$$(id -u)" != 0 ] && command -v sudo >/dev/null 2>&1; then SUDO=sudo; fi; \
		echo "chromium or chromedriver not on PATH: installing them with apt-get"; \
		$$SUDO apt-get update -qq && $$SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq \
			--no-install-recommends chromium chromium-driver; \
	}

# The reference MobileFaceNet (from ../shared/data; never shipped) as an ONNX model folder, with its
# LFW accuracy and its cosine thresholds calibrated on every pair of LFW's photos (minutes, once).
# Imported again when the ONNX export changes (models/onnx_export.py).
$(REF_MODEL)/model.onnx: models/onnx_export.py | install
	$(BIN)/sphereface import mobilefacenet $(SHARED)/data/reference_models/mobilefacenet_casia/068.ckpt --out $(REF_MODEL)

$(REF_MODEL)/lfw_detect.json: $(REF_MODEL)/model.onnx
	$(BIN)/sphereface evaluate lfw --model $(REF_MODEL) --data $(SHARED)/data/lfw --landmarks detect \
		--write-lfw --json $@.partial --plot $(REF_MODEL)/lfw_detect.png
	$(BIN)/sphereface calibrate --model $(REF_MODEL) --lfw $(SHARED)/data/lfw --json $(REF_MODEL)/calibration.json
	mv $@.partial $@

models: $(REF_MODEL)/lfw_detect.json

# Every number of the default model's card (models/dlib_resnet_v1, about 25 minutes on 2 cores): the
# template fit on celeba_faces, the flip-fusion choice, LFW (file and detect landmarks), dlib's own
# pipeline on the same pairs, the threshold calibration on every pair of LFW's photos.
DLIB_RESULTS := $(DLIB_MODEL)
default-model-results: install
	$(BIN)/python -m training.dlib_template $(SHARED)/data/celeba_faces --json docs/results/dlib_template.json
	$(BIN)/python -m training.flip_fusion --model $(DLIB_MODEL) --data $(SHARED)/data/celeba_faces \
		--json docs/results/dlib_flip_fusion.json
	$(BIN)/sphereface evaluate lfw --model $(DLIB_MODEL) --data $(SHARED)/data/lfw --landmarks file \
		--json $(DLIB_RESULTS)/lfw_file.json
	$(BIN)/sphereface evaluate lfw --model $(DLIB_MODEL) --data $(SHARED)/data/lfw --landmarks detect \
		--write-lfw --json $(DLIB_RESULTS)/lfw_detect.json --plot $(DLIB_RESULTS)/lfw_roc.png
	$(BIN)/python bench/dlib_pipeline.py --data $(SHARED)/data/lfw --json docs/results/dlib_own_pipeline_lfw.json
	$(BIN)/sphereface calibrate --model $(DLIB_MODEL) --lfw $(SHARED)/data/lfw \
		--json $(DLIB_RESULTS)/calibration.json --plot $(DLIB_RESULTS)/calibration.png

# The face quality score (docs/results/quality.md): its fit on LFW and degraded copies, the
# error-versus-reject curves, the enrollment floor and which subject score identifies best (about
# 15 minutes on 2 cores the first time, a minute once the faces are cached).
quality-results: install
	$(BIN)/python -m training.evaluation.quality_results --model $(DLIB_MODEL) --lfw $(SHARED)/data/lfw \
		--out docs/results

# The default model in int8 (docs/results/face-path.md "The int8 embedder"): quantised on celeba_faces
# photos, its LFW accuracy, thresholds from every LFW pair, and its speed against the float model.
INT8_MODEL := $(CACHE)/models/dlib_resnet_v1_int8
int8-model: install
	$(BIN)/sphereface quantize --calibration $(SHARED)/data/celeba_faces --out $(INT8_MODEL)
	$(BIN)/sphereface evaluate lfw --model $(INT8_MODEL) --data $(SHARED)/data/lfw --landmarks file \
		--json $(INT8_MODEL)/lfw_file.json
	$(BIN)/sphereface calibrate --model $(INT8_MODEL) --lfw $(SHARED)/data/lfw \
		--json $(INT8_MODEL)/calibration.json --no-progress
	$(BIN)/python bench/quantized.py --int8 $(INT8_MODEL) --json docs/results/bench_quantized.json

# The command-line reference, written from the parser (tests/test_architecture.py checks it is current).
cli-docs: install
	$(BIN)/python -m models.cli_reference --out docs/reference/cli.md

lint: install
	$(BIN)/ruff check models training service tests bench

test: install install-browser
	$(BIN)/ruff check models training service tests bench
	$(BIN)/python -m pytest -q

# Screenshots of the page in docs/screenshots, taken by its browser tests (README and docs/guides/page.md).
screenshots: install install-browser
	SPHEREFACE_SCREENSHOTS=docs/screenshots $(BIN)/python -m pytest -q tests/test_page_browser.py

# The CPU container image, built here with buildah and checked inside: /readyz and a /v1/verify of
# two real photos against a local Redis, no torch, non-root (root, network, about 2 minutes; not
# part of make test; docs/guides/deploy.md).
image-test: install
	SHARED=$(SHARED) bash docker/image_test.sh

# The fault and load suite of the service (docs/results/reliability-suite.md; about 5 minutes): load levels,
# SIGKILL of Redis and of the API during enrollment, a paused Redis, two workers, SIGKILL of serve's own
# redis-server and of serve --workers 2, Redis paused under load, a noisy key, hostile images and requests.
reliability: install
	$(BIN)/python bench/reliability.py --markdown docs/results/reliability.md --json docs/results/reliability.json

# The service on the default model (dlib's CC0 ResNet, converted into models/dlib_resnet_v1 by install).
serve: install
	$(BIN)/sphereface serve

# Training data: celeba_faces and celeba_small detected and aligned once into packed crops (about
# 1 minute each); the celeba_more configs train on both as one set.
$(CELEBA)/manifest.json: | install
	$(BIN)/sphereface prepare $(SHARED)/data/celeba_faces --out $(CELEBA)

$(CELEBA_SMALL)/manifest.json: | install
	$(BIN)/sphereface prepare $(SHARED)/data/celeba_small --out $(CELEBA_SMALL)

prepare-celeba: $(CELEBA)/manifest.json $(CELEBA_SMALL)/manifest.json

# Every face run of the configs $(1) under the folder $(2) exported into RUN/model and evaluated on
# MegaFace local-v1 into RUN/megaface_local.json (either kept when it is already there).
define export_and_megaface
for config in $(1); do \
	run=$(2)/$$(basename $$config .toml); \
	test -f $$run/summary.json || { echo "$$run stopped before its end (see $$run/stopped.json): not exported"; continue; }; \
	test -f $$run/model/manifest.json || $(BIN)/sphereface export $$run --out $$run/model || exit 1; \
	test -f $$run/megaface_local.json || $(BIN)/sphereface evaluate megaface --model $$run/model \
		--protocol local --data $(SHARED)/data --json $$run/megaface_local.json || exit 1; \
done
endef

# The loss comparison of docs/results/loss-comparison.md: the SphereFace-4 runs of 2,000 steps on celeba_faces +
# celeba_small (about 20 minutes each on one core, two at a time; finished runs are kept), then the
# fine-tuning runs (*_finetune.toml: 1,000 steps from a trained run), each exported and evaluated
# on MegaFace local-v1 (about 3 minutes each), then the table. Runs the trainer stopped (stopped.json: a NaN
# loss) are kept and get a row that says so.
loss-table: prepare-celeba
	for configs in "$(filter-out %_finetune.toml,$(LOSS_CONFIGS))" "$(filter %_finetune.toml,$(LOSS_CONFIGS))"; do \
		printf '%s\n' $$configs | xargs -P 2 -I{} sh -c \
			'run=runs/celeba_more/$$(basename {} .toml); test -f $$run/summary.json -o -f $$run/stopped.json \
			|| $(BIN)/sphereface train {} --no-progress' \
			|| exit 1; \
	done
	$(call export_and_megaface,$(LOSS_CONFIGS),runs/celeba_more)
	$(BIN)/python -m training.loss_table $(patsubst training/configs/celeba_more/%.toml,runs/celeba_more/%,$(LOSS_CONFIGS)) \
		--json docs/results/loss_table.json --markdown docs/results/loss_table.md \
		--plot docs/results/loss_table_curves.png
	$(BIN)/python -m training.loss_table $(SFPLUS_RUNS) --plot docs/results/loss_table_curves_sphereface_plus.png
	$(BIN)/python -m training.loss_table $(CAFFE_RUNS) --plot docs/results/loss_table_curves_caffe.png
	$(BIN)/python -m training.mhe_diagnostics $(filter-out %_m2_mhe10,$(SFPLUS_RUNS)) \
		--config training/configs/celeba_more/sf4_sphereface_plus_finetune.toml --json docs/results/mhe_diagnostics.json
	$(BIN)/python -m training.mhe_diagnostics $(addprefix runs/celeba_more/,sf4_asoftmax_m4_finetune \
		sf4_sphereface_plus_finetune sf4_sphereface_plus_caffe_finetune) \
		--config training/configs/celeba_more/sf4_sphereface_plus_caffe_finetune.toml --json docs/results/mhe_diagnostics_caffe.json

# docs/results/opt-claims.md: the OPT and CoMHE CIFAR-10 runs (22 runs of CNN-6, 3 to 14 minutes each on one core)
# and two SphereFace-4 face runs on the CelebA sets (OPT-CP and RP-CoMHE, 25 and 35 minutes), two at a
# time, longest first; the face runs exported and evaluated on MegaFace local-v1; then the tables and
# curves. About 90 minutes on two cores. Finished runs are kept.
OPT_CONFIGS := $(sort $(wildcard training/configs/opt/cifar/cnn6_*.toml))
OPT_FACES := $(sort $(wildcard training/configs/opt/sf4_*.toml))
opt-table: prepare-celeba
	printf '%s\n' $(OPT_FACES) $(filter %_gs.toml %_gs_seed1.toml %_learnable_v.toml,$(OPT_CONFIGS)) \
		$(filter-out %_gs.toml %_gs_seed1.toml %_learnable_v.toml,$(OPT_CONFIGS)) | xargs -P 2 -I{} sh -c \
		'run=$$(sed -n "s/^name = \"\(.*\)\"/\1/p" {}); test -n "$$(find runs/opt -name summary.json -path "*/$$run/*" 2>/dev/null)" \
		|| OMP_NUM_THREADS=1 $(BIN)/sphereface train {} --no-progress'
	$(call export_and_megaface,$(OPT_FACES),runs/opt)
	$(BIN)/python -m training.opt_table --runs runs/opt/cifar --faces runs/opt --out docs/results

# What OPT and compressive MHE cost per CNN-6 training step against plain training (docs/results/opt-claims.md,
# CoMHE Table E.5): 13 variants interleaved, median of 5 rounds with the range (about 3 minutes).
bench-opt: install
	$(BIN)/python bench/opt.py --json docs/results/bench_opt.json

# docs/results/hyperspherical-claims.md: 34 CIFAR-10 runs of SphereNet's claims (0.5 to 8 minutes each on one core,
# two at a time) and three SphereFace-4 runs on the CelebA sets (SphereConv at lr 0.1 and 0.025, and
# its convolutional control; about 35 minutes each), exported and evaluated on LFW and MegaFace
# local-v1, then the tables and curves. About 1 h 45 min on two cores (measured 2026-11-25).
# Finished runs are kept, and so are runs the trainer stopped (stopped.json: a NaN loss or collapsed features).
hyperspherical-table: prepare-celeba
	printf '%s\n' $(HS_CONFIGS) $(HS_FACES) | xargs -P 2 -I{} sh -c \
		'run=$$(sed -n "s/^name = \"\(.*\)\"/\1/p" {}); test -n "$$(find runs/hyperspherical \( -name summary.json -o -name stopped.json \) -path "*/$$run/*")" \
		|| OMP_NUM_THREADS=1 $(BIN)/sphereface train {} --no-progress'
	$(call export_and_megaface,$(HS_FACES),runs/hyperspherical)
	$(BIN)/python -m training.hyperspherical_table --runs runs/hyperspherical --out docs/results

# What SphereConv, SphereNorm and DCNet's operators cost per training step against convolutions
# (docs/results/hyperspherical-claims.md; a few minutes).
bench-hyperspherical: install
	$(BIN)/python bench/hyperspherical.py --json docs/results/bench_hyperspherical.json

# Re-train the project's own SphereFace model into models/sphereface_celeba: two MobileFaceNets
# (version 3's recipe, and the same with photometric augmentation), one thread each side by side
# (about 2.6 hours), exported and combined into one ONNX graph (`sphereface combine`), evaluated on
# LFW and calibrated (about 10 minutes). Finished runs are kept.
CELEBA_PARTS := mobilefacenet_m4 mobilefacenet_m4_colour
sphereface-celeba-model: prepare-celeba
	printf '%s\n' $(CELEBA_PARTS) | xargs -P 2 -I{} sh -c \
		'test -f runs/celeba_more/{}/summary.json || OMP_NUM_THREADS=1 $(BIN)/sphereface train \
		training/configs/celeba_more/{}.toml --set threads=1 --no-progress'
	for run in $(CELEBA_PARTS); do \
		$(BIN)/sphereface export runs/celeba_more/$$run --out runs/celeba_more/$$run/model || exit 1; \
	done
	$(BIN)/sphereface combine $(foreach run,$(CELEBA_PARTS),runs/celeba_more/$(run)/model) \
		--out models/sphereface_celeba --name sphereface_mobilefacenet_celeba --version 4 --lfw $(SHARED)/data/lfw
	for run in $(CELEBA_PARTS); do \
		mkdir -p models/sphereface_celeba/parts/$$run && \
		cp runs/celeba_more/$$run/config.toml runs/celeba_more/$$run/log.csv runs/celeba_more/$$run/curves.png \
			runs/celeba_more/$$run/summary.json models/sphereface_celeba/parts/$$run/ || exit 1; \
	done

# Training throughput, our loaders against a PIL-decoding DataLoader (on a GPU when there is one).
bench-train: prepare-celeba
	$(BIN)/python bench/train_loader.py --data $(CELEBA)

# What the trainer's own step costs on CPU against a bare PyTorch loop on the same network, batch and
# data (docs/results/train-overhead.md; the loss table's A-Softmax m = 4 run, one thread, about 2 minutes).
bench-train-overhead: prepare-celeba
	OMP_NUM_THREADS=1 $(BIN)/python bench/train_overhead.py --json docs/results/bench_train_overhead.json

# Video identification on clips made from LFW photos: per-track against per-frame accuracy, purity,
# frames per second at 720p and 1080p (docs/results/video.md; about 10 minutes on 2 cores).
bench-video: install
	$(BIN)/python bench/video.py --json docs/results/bench_video.json

# Unknown-face clustering on all of LFW against an immich-style rule, and the cost per face up to 1M
# pooled faces (docs/results/unknown-clusters.md; about 15 minutes on 2 cores, the embeddings cached).
bench-unknown-clusters: install
	$(BIN)/python bench/unknown_clusters.py --write-model --json docs/results/unknown_clusters.json
	OPENBLAS_NUM_THREADS=1 $(BIN)/python bench/unknown_clusters.py --cost-only --repeats 30

# The GPU check (docs/gpu.md). gpu-pack, here: the prepared celeba_faces crops and 600 LFW pairs as JPEG in
# .cache/gpu-pack (about 26 MiB, seconds), which the device tool carries to a lent GPU machine. gpu-check:
# the check in one command, within a time budget, its table last and its JSON in $OUT (else
# runs/gpu_check): the full run on a GPU (about 8 minutes), a tiny one on a CPU (about a minute; make test
# runs it too). On the GPU machine there is no .venv: python3 runs it from the checkout.
GPU_PACK := $(CACHE)/gpu-pack
GPU_PYTHON := $(if $(wildcard $(BIN)/python),$(BIN)/python,python3)
gpu-pack: $(CELEBA)/manifest.json
	$(BIN)/python bench/gpu_pack.py --data $(CELEBA) --lfw $(SHARED)/data/lfw --out $(GPU_PACK)

$(GPU_PACK)/pack.json:
	$(MAKE) gpu-pack

gpu-check: $(GPU_PACK)/pack.json
	PYTHONPATH=. $(GPU_PYTHON) bench/gpu_check.py --pack $(GPU_PACK) $(GPU_CHECK_ARGS)

# The MegaFace protocol, local-v1, for the default, the reference and the project-trained model: JSON,
# plots and the side-by-side table in docs/results/megaface/ (about 5 minutes per model on 2 cores; cached).
MEGAFACE := docs/results/megaface
megaface-local: models
	$(BIN)/sphereface evaluate megaface --model default --protocol local --data $(SHARED)/data \
		--json $(MEGAFACE)/local_dlib.json --plots $(MEGAFACE)/dlib
	$(BIN)/sphereface evaluate megaface --model $(REF_MODEL) --protocol local --data $(SHARED)/data \
		--json $(MEGAFACE)/local_reference.json --plots $(MEGAFACE)/reference
	$(BIN)/sphereface evaluate megaface --model sphereface_celeba --protocol local --data $(SHARED)/data \
		--json $(MEGAFACE)/local_sphereface_celeba.json --plots $(MEGAFACE)/sphereface_celeba
	$(BIN)/sphereface report $(MEGAFACE)/local_dlib.json $(MEGAFACE)/local_reference.json \
		$(MEGAFACE)/local_sphereface_celeba.json \
		--names "default: dlib ResNet (CC0),reference MobileFaceNet (CASIA-WebFace),sphereface_celeba v4 (two MobileFaceNets; celeba_faces + celeba_small)" \
		--out $(MEGAFACE)/local_v1.md

# 1,000,000 distractors on this machine: time and peak memory (docs/results/megaface.md).
bench-megaface-1m: install
	$(BIN)/python bench/megaface_1m.py --model models/sphereface_celeba --json docs/results/megaface_1m.json

# The real torchvision, only to time facenet-pytorch's NMS calls in its C++ kernel (the benchmarks
# run facenet-pytorch on a pure-torch stand-in): torch 2.14.1 + torchvision 0.29.1 from the machine's
# disk in their own environment (a CUDA build, about 5.5 GB, once; bench/torchvision_nms.py).
TORCHVISION_ENV := $(CACHE)/bench/torchvision-venv
$(TORCHVISION_ENV)/bin/python:
	$(PYTHON) -m venv $(TORCHVISION_ENV)
	$(TORCHVISION_ENV)/bin/pip install -q torch==2.14.1 torchvision==0.29.1 numpy
	@$(TORCHVISION_ENV)/bin/python -c "import torchvision.ops" || { rm -rf $(TORCHVISION_ENV); exit 1; }

torchvision-env: $(TORCHVISION_ENV)/bin/python

bench: install models torchvision-env
	$(BIN)/python bench/face_path.py --model $(REF_MODEL)

# The service: /v1/verify against facenet-pytorch + PyTorch eager, search at 10k/100k/1M
# vectors (numpy and Redis Query Engine), bulk enrollment (about 15 minutes; docs/results/service.md).
bench-service: install models torchvision-env
	$(BIN)/python bench/service.py --json docs/results/bench_service.json
	$(BIN)/python bench/models.py --models default,sphereface_celeba,$(REF_MODEL) --json docs/results/bench_models.json
	$(MAKE) bench-verify-default

# /v1/verify of the default model (dlib's ResNet) against facenet-pytorch + PyTorch eager running the
# same network rebuilt from dlib's file (about 3 minutes).
bench-verify-default: install torchvision-env
	$(BIN)/python bench/service.py --parts verify --model models/dlib_resnet_v1 \
		--json docs/results/bench_service_verify_default.json

# What decoding costs (docs/results/face-path.md "Decoding at the scale detection needs"): JPEGs at
# the scale detection needs against full size, agreement, the 6000x6000 bomb, a worker's memory after
# hostile and normal photos, and LFW detecting on half-size decodes (about 10 minutes).
bench-decode: install
	$(BIN)/python bench/decode_cost.py --service --lfw $(SHARED)/data/lfw --json docs/results/bench_decode_cost.json

# The detector's ONNX Runtime session options, and its two threads one stage at a time against side by
# side, on the phone photos (docs/results/face-path.md; a few minutes each).
bench-session-options: install
	$(BIN)/python bench/detector_session_options.py --data $(SHARED)/data \
		--json docs/results/bench_detector_session_options.json

bench-detector-threads: install
	$(BIN)/python bench/detector_threads.py --data $(SHARED)/data --rounds 7 --json docs/results/bench_detector_threads.json

# The largest face coarse to fine (what /v1/verify uses) against detecting every face: speed on the
# phone photos, agreement, and LFW's protocol with each photo's largest face both ways (about 5 minutes).
bench-largest-face: install
	$(BIN)/python bench/largest_face.py --lfw $(SHARED)/data/lfw --json docs/results/bench_largest_face.json

# LFW's 6,000 View-2 pairs written as an insightface .bin (ArcFace 112x112 faces aligned with landmarks.txt,
# JPEG q95) and evaluated both ways, `evaluate bin` against `evaluate lfw --landmarks file`, for the default
# and the project-trained model (about 25 minutes on 2 shared cores; docs/results/verification-sets.md).
.PHONY: bench-lfw-bin
bench-lfw-bin: install
	$(BIN)/python bench/lfw_bin.py --data $(SHARED)/data/lfw --model default --model sphereface_celeba \
		--json docs/results/lfw_bin.json

# Exact search at 1M and 10M faces: float32 against the int8 scan with exact re-rank, 5 interleaved
# rounds (about 3 minutes, 16 GB of memory at 10M; docs/results/service.md "Search at 10M faces").
bench-gallery-scan: install
	$(BIN)/python bench/gallery_scan.py --json docs/results/bench_gallery_scan.json

# The gallery on one plain redis-server against a Redis Cluster of 3 primaries (no replicas), through the
# service's GalleryStore and LiveIndex: bulk enrollment (2 writer processes), Redis memory per primary, a
# pod's load time and memory, identification latency, interleaved rounds. 1M faces: about 2.5 GB of Redis
# memory per layout, 2.5 GB for the two pods, 6 to 10 minutes on 2 shared cores (docs/results/cluster.md);
# .venv/bin/python bench/cluster.py --faces 20000 runs the same in about 15 seconds.
.PHONY: bench-cluster
bench-cluster: install
	$(BIN)/python bench/cluster.py --faces 1000000 --json docs/results/bench_cluster.json

# Memory of sphereface serve --workers 2 at 1M faces, each worker its own copy against one shared
# snapshot, and search over the snapshot (about 6 minutes; docs/results/service.md "Memory with two workers").
bench-gallery-memory: install
	$(BIN)/python bench/gallery_memory.py --json docs/results/bench_gallery_memory.json

# /v1/verify of the same photo pairs with the default model, the project-trained one (the old
# default) and the reference: latency (median of 5 interleaved rounds, with the range) and
# decisions at each model's thresholds (part of bench-service; about 3 minutes alone), and the
# default model's int8 copy when `make int8-model` has made it.
bench-models: install models
	$(BIN)/python bench/models.py --models default,$$(test -f $(INT8_MODEL)/model.onnx && echo $(INT8_MODEL),)sphereface_celeba,$(REF_MODEL) \
		--json docs/results/bench_models.json

clean:
	rm -rf $(VENV) $(CACHE) *.egg-info
