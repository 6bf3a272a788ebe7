"""coop: prompt learning on CLIP (CoOp), exact and fast.

import coop
clip = coop.load_clip("ViT-B-16", pretrained="openai")
learner = coop.PromptLearner(clip, ["cat", "dog"], n_ctx=4, position="end")
classifier = coop.PromptClassifier(clip, learner)
logits = classifier(images)                      # (B, n_cls)
"""

from coop.image_encoder import ImageTransformer, VisionConfig
from coop.model import CLIP, cosine_logits
from coop.prompt import PromptClassifier, PromptLearner
from coop.text_encoder import TextConfig, TextTransformer
from coop.weights import load_clip

__all__ = [
    "CLIP",
    "ImageTransformer",
    "PromptClassifier",
    "PromptLearner",
    "TextConfig",
    "TextTransformer",
    "VisionConfig",
    "cosine_logits",
    "load_clip",
]
__version__ = "0.1.0"
