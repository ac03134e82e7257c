"""350M sparse + low-rank LLaMA (SLTrain: W = (alpha/r)·B·A + S) on the zoo's 350M shape: r 256,
alpha 16, S with density 0.03 on a random support of 16 x 16 blocks (SLTrain's support is element-wise,
`--config.model.sparse_block=1`, which gathers every nonzero's input per token).

Recipe: SLTrain's (AdamW betas (0.9, 0.999), wd 0, clip 0, peak lr 3e-3, 65k steps,
6500 warmup steps, cosine to 0.1x, seq 256, global batch 512).
Point data.path at your tokenized corpus.
"""

from boost_jax.config import sltrain_config


def get_config():
    return sltrain_config("350m")
