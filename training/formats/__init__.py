"""Training-set formats that other tools distribute, read without those tools: MXNet's RecordIO
container (:mod:`training.formats.recordio`), insightface's layout of face sets inside it
(:mod:`training.formats.insightface`) and its preparation into the project's packed shards
(:mod:`training.formats.prepare_recordio`)."""
