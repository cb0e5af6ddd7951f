"""Models out of lmyard: Hugging Face folders and the MLflow pyfunc model."""
