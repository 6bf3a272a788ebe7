"""coop: prompt learning on CLIP (CoOp), exact and fast.

import coop
clip = coop.load_clip("ViT-B-16", pretrained="openai")
learner = coop.PromptLearner(clip, ["cat", "dog"], n_ctx=4, position="end")
classifier = coop.PromptClassifier(clip, learner)
logits = classifier(images)                      # (B, n_cls)

clf = coop.load_classifier("runs/.../seed1")     # a run folder or a tools/export.py file
probs = clf.predict(images)                      # (B, n_cls), images from clf.transform
"""

from coop.interop import Classifier, load_classifier
from coop.model.clip import CLIP, cosine_logits
from coop.model.image_encoder import ImageTransformer, VisionConfig
from coop.model.prompt import PromptClassifier, PromptLearner
from coop.model.text_encoder import TextConfig, TextTransformer
from coop.model.weights import load_clip

__all__ = [
    "CLIP",
    "Classifier",
    "ImageTransformer",
    "PromptClassifier",
    "PromptLearner",
    "TextConfig",
    "TextTransformer",
    "VisionConfig",
    "cosine_logits",
    "load_classifier",
    "load_clip",
]
__version__ = "0.1.0"
