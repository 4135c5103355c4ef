"""``deepspeed.runtime.sequence_parallel.ulysses_sp``: the attention wrapper and the data-loader adapter accelerate
and the Trainer use, and ALST's tiled compute (hf_zero.sequence_parallel)."""

from hf_zero.integrations.deepspeed_shim._forward import forward as _forward

_forward(__name__, {"UlyssesSPAttentionHF": "hf_zero.sequence_parallel.attention:UlyssesSPAttentionHF",
                    "UlyssesSPDataLoaderAdapter": "hf_zero.sequence_parallel.dataloader:UlyssesSPDataLoaderAdapter",
                    **{name: f"hf_zero.sequence_parallel.tiled:{name}" for name in (
                        "sequence_tiled_compute", "TiledFusedLogitsLoss", "TiledMLP")}})
