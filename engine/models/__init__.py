"""The model families, one module each, and the registry that maps config.json's model_type to
one (registry.py). A model is built from layers/ and reads the kernels' plans; it knows nothing
of scheduling, workers or speculation beyond the MTP head it may carry (mtp_head.py).

May import layers/, kernels/, parallel/, interfaces/ and the config modules.
"""
