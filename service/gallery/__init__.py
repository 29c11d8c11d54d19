"""The face gallery: subjects and faces in Redis, searched exactly in-process or by Redis KNN."""
