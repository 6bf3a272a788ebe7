"""What CoOp publishes about its datasets: the split sizes and where each download comes from.

Used by the data doctor (`coop.data.doctor`, `tools/check_data.py`). Both tables are quoted from
CoOp's own material: `COOP_SPLIT_SIZES` from its paper (`SPLIT_SIZES_SOURCE`), `DOWNLOADS` from
its DATASETS.md (github.com/KaiyangZhou/CoOp), as (what to fetch, from where).
"""

from __future__ import annotations

from coop.data.imagenet_variants import IMAGENET_VARIANTS

# The 11 datasets of CoOp's few-shot table, then the 4 test-only ImageNet variants.
COOP_DATASETS = (
    "imagenet", "caltech101", "oxford_pets", "stanford_cars", "oxford_flowers", "food101",
    "fgvc_aircraft", "sun397", "dtd", "eurosat", "ucf101", *IMAGENET_VARIANTS,
)  # fmt: skip
CHECKABLE = (*COOP_DATASETS, "imagefolder", "cifar10", "cifar100")

SPLIT_SIZES_SOURCE = (
    "CoOp (Zhou et al., IJCV 2022), appendix table of dataset statistics (classes, train, val, "
    "test); ImageNet's train count is the ILSVRC-2012 train set the paper rounds to 1.28M"
)
# name -> (classes, train, val, test); None: no such split in CoOp's setup (ImageNet has no val:
# our reader, like CoOp, validates on the test set; the variants are test sets only).
COOP_SPLIT_SIZES: dict[str, tuple[int, int | None, int | None, int]] = {
    "imagenet": (1000, 1_281_167, None, 50_000),
    "caltech101": (100, 4_128, 1_649, 2_465),
    "oxford_pets": (37, 2_944, 736, 3_669),
    "stanford_cars": (196, 6_509, 1_635, 8_041),
    "oxford_flowers": (102, 4_093, 1_633, 2_463),
    "food101": (101, 50_500, 20_200, 30_300),
    "fgvc_aircraft": (100, 3_334, 3_333, 3_333),
    "sun397": (397, 15_880, 3_970, 19_850),
    "dtd": (47, 2_820, 1_128, 1_692),
    "eurosat": (10, 13_500, 5_400, 8_100),
    "ucf101": (101, 7_639, 1_898, 3_783),
    "imagenetv2": (1000, None, None, 10_000),
    "imagenet_sketch": (1000, None, None, 50_889),
    "imagenet_a": (200, None, None, 7_500),
    "imagenet_r": (200, None, None, 30_000),
}

_IMAGENET_CLASSNAMES = "https://drive.google.com/file/d/1-61f_ol79pViBFDG_IDlUQSwoLcn2XXF/view"
_COPY_CLASSNAMES = ("classnames.txt", "<DATA>/imagenet/ (copy it, as CoOp's instructions say)")
# From CoOp's DATASETS.md: name -> {"images": (what, from where), "files": (what, from where)}.
DOWNLOADS: dict[str, dict[str, tuple[str, str]]] = {
    "imagenet": {
        "images": ("the ILSVRC-2012 train and val sets (one <wnid>/ folder per class in each)", "https://image-net.org"),
        "files": ("classnames.txt", _IMAGENET_CLASSNAMES),
    },
    "caltech101": {
        "images": ("101_ObjectCategories.tar.gz", "http://www.vision.caltech.edu/Image_Datasets/Caltech101/101_ObjectCategories.tar.gz"),
        "files": ("split_zhou_Caltech101.json", "https://drive.google.com/file/d/1hyarUivQE36mY6jSomru6Fjd-JzwcCzN/view"),
    },
    "oxford_pets": {
        "images": ("images.tar.gz", "https://www.robots.ox.ac.uk/~vgg/data/pets/data/images.tar.gz"),
        "files": ("split_zhou_OxfordPets.json", "https://drive.google.com/file/d/1501r8Ber4nNKvmlFVQZ8SeUHTcdTTEqs/view"),
    },
    "stanford_cars": {
        "images": ("cars_train.tgz and cars_test.tgz", "http://ai.stanford.edu/~jkrause/car196/ (cars_train.tgz, cars_test.tgz)"),
        "files": ("split_zhou_StanfordCars.json", "https://drive.google.com/file/d/1ObCFbaAgVu0I-k_Au-gIUcefirdAuizT/view"),
    },
    "oxford_flowers": {
        "images": ("102flowers.tgz", "https://www.robots.ox.ac.uk/~vgg/data/flowers/102/102flowers.tgz"),
        "files": ("split_zhou_OxfordFlowers.json", "https://drive.google.com/file/d/1Pp0sRXzZFZq15zVOzKjKBu4A9i01nozT/view"),
    },
    "food101": {
        "images": ("food-101.tar.gz", "https://data.vision.ee.ethz.ch/cvl/datasets_extra/food-101/"),
        "files": ("split_zhou_Food101.json", "https://drive.google.com/file/d/1QK0tGi096I0Ba6kggatX1ee6dJFIcEJl/view"),
    },
    "fgvc_aircraft": {
        "images": ("fgvc-aircraft-2013b.tar.gz (keep only its data/ folder, renamed fgvc_aircraft/)", "https://www.robots.ox.ac.uk/~vgg/data/fgvc-aircraft/archives/fgvc-aircraft-2013b.tar.gz"),
        "files": ("the data/ folder of fgvc-aircraft-2013b.tar.gz", "https://www.robots.ox.ac.uk/~vgg/data/fgvc-aircraft/archives/fgvc-aircraft-2013b.tar.gz"),
    },
    "sun397": {
        "images": ("SUN397.tar.gz", "http://vision.princeton.edu/projects/2010/SUN/SUN397.tar.gz"),
        "files": ("split_zhou_SUN397.json", "https://drive.google.com/file/d/1y2RD81BYuiyvebdN-JymPfyWYcd8_MUq/view"),
    },
    "dtd": {
        "images": ("dtd-r1.0.1.tar.gz", "https://www.robots.ox.ac.uk/~vgg/data/dtd/download/dtd-r1.0.1.tar.gz"),
        "files": ("split_zhou_DescribableTextures.json", "https://drive.google.com/file/d/1u3_QfB467jqHgNXC00UIzbLZRQCg2S7x/view"),
    },
    "eurosat": {
        "images": ("EuroSAT.zip", "http://madm.dfki.de/files/sentinel/EuroSAT.zip"),
        "files": ("split_zhou_EuroSAT.json", "https://drive.google.com/file/d/1Ip7yaCWFi0eaOFUGga0lUdVi_DDQth1o/view"),
    },
    "ucf101": {
        "images": ("UCF-101-midframes.zip (the middle frame of each video)", "https://drive.google.com/file/d/10Jqome3vtUA2keJkNanAiFpgbyC9Hc2O/view"),
        "files": ("split_zhou_UCF101.json", "https://drive.google.com/file/d/1I0S0q91hJfsV9Gf4xDIjgDq4AqBNJb1y/view"),
    },
    "imagenetv2": {
        "images": ("imagenetv2-matched-frequency.tar.gz", "https://s3-us-west-2.amazonaws.com/imagenetv2public/imagenetv2-matched-frequency.tar.gz"),
        "files": _COPY_CLASSNAMES,
    },
    "imagenet_sketch": {
        "images": ("ImageNet-Sketch", "https://github.com/HaohanWang/ImageNet-Sketch"),
        "files": _COPY_CLASSNAMES,
    },
    "imagenet_a": {
        "images": ("imagenet-a.tar", "https://github.com/hendrycks/natural-adv-examples"),
        "files": _COPY_CLASSNAMES,
    },
    "imagenet_r": {
        "images": ("imagenet-r.tar", "https://github.com/hendrycks/imagenet-r"),
        "files": _COPY_CLASSNAMES,
    },
    # not CoOp's: the CIFAR protocols of FedOTP and FedPGP (torchvision's python-version archives)
    "cifar10": {
        "images": ("cifar-10-python.tar.gz", "https://www.cs.toronto.edu/~kriz/cifar-10-python.tar.gz"),
        "files": ("cifar-10-python.tar.gz", "https://www.cs.toronto.edu/~kriz/cifar-10-python.tar.gz"),
    },
    "cifar100": {
        "images": ("cifar-100-python.tar.gz", "https://www.cs.toronto.edu/~kriz/cifar-100-python.tar.gz"),
        "files": ("cifar-100-python.tar.gz", "https://www.cs.toronto.edu/~kriz/cifar-100-python.tar.gz"),
    },
}  # fmt: skip
