"""What a registered model needs to serve, and nothing else: decoding, preprocessing, the
network's architecture and the MLflow pyfunc model (pyfunc_model.py).

This package travels with every registered model as its only code (MLflow `code_paths`), so a
serving host needs MLflow, torch, torchvision, safetensors, Pillow and pandas, not this
project. Training imports the same functions from here, so an image is decoded and normalised
the same way when it is trained on, evaluated and served. It imports nothing of the project.
"""

WEIGHTS_ARTIFACT, DESCRIPTION_ARTIFACT = "weights", "description"
"""The registered model's artifacts, as register_model logs them and pyfunc_model reads them."""
