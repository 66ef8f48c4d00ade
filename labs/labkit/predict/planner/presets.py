"""Published shapes, each with its source: the models the planner, its command line and the
sizing page offer by name (PRESETS). A new one is a Model with its source in a comment."""

from .. import memory_model
from .shapes import Model


def _deepseek_v3():
    c = memory_model.DEEPSEEK_V3
    attention = memory_model.mla_attention_params(
        c["hidden"], c["heads"], c["q_rank"], c["kv_rank"], c["head_dim"], c["rope_dim"],
        c["v_head_dim"])
    return Model(layers=c["layers"], hidden=c["hidden"], heads=c["heads"], seq=4096,
                 vocab=c["vocab"], ffn_hidden=c["dense_ffn"], gpt=False,
                 experts=c["routed_experts"], top_k=c["top_k"], expert_hidden=c["expert_ffn"],
                 shared_experts=c["shared_experts"], dense_layers=c["dense_layers"],
                 attention_params=attention, qk_head_dim=c["head_dim"] + c["rope_dim"],
                 v_head_dim=c["v_head_dim"], node_limit=4, name="DeepSeek-V3")


# Published shapes. GPT-3: Brown et al. (2020), Table 2.1, its vocabulary padded to 51,200
# as Megatron-LM pads GPT-2's. Llama 3: Dubey et al. (2024), Table 3 (8,192-token
# pre-training sequences). DeepSeek-V3: its report, section 2 and 4.2 (4,096-token
# sequences), memory_model.DEEPSEEK_V3.
PRESETS = {
    "gpt3-175b": Model(96, 12288, 96, 2048, 51200, name="GPT-3 175B"),
    "llama3-8b": Model(32, 4096, 32, 8192, 128256, ffn_hidden=14336, kv_heads=8, gpt=False,
                       name="Llama 3 8B"),
    "llama3-70b": Model(80, 8192, 64, 8192, 128256, ffn_hidden=28672, kv_heads=8, gpt=False,
                        name="Llama 3 70B"),
    "llama3-405b": Model(126, 16384, 128, 8192, 128256, ffn_hidden=53248, kv_heads=8,
                         gpt=False, name="Llama 3 405B"),
    "deepseek-v3": _deepseek_v3(),
}
