"""The FastAPI face service and the ``sphereface`` command line. Never imports torch."""
