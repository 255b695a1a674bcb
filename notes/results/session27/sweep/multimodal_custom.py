"""Hand-built composite models (used by run_one.py as MODEL_TYPE=custom:NAME)."""
import torch
import transformers as T
from run_one import TEXT, shrink_sub

S = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
         num_key_value_heads=2, head_dim=16, max_position_embeddings=512, bos_token_id=1, eos_token_id=2,
         pad_token_id=0)
V = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2)


def gemma3():
    text = T.Gemma3TextConfig(**S, sliding_window=8, layer_types=["sliding_attention", "full_attention"],
                              initializer_range=0.02)
    vis = T.SiglipVisionConfig(**V, image_size=28, patch_size=14)
    cfg = T.Gemma3Config(text_config=text, vision_config=vis, mm_tokens_per_image=4, image_token_index=120,
                         boi_token_index=121, eoi_token_index=122, initializer_range=0.02)
    return T.Gemma3ForConditionalGeneration(cfg)


def paligemma():
    text = T.GemmaConfig(**S, initializer_range=0.3)
    vis = T.SiglipVisionConfig(**V, image_size=28, patch_size=14, projection_dim=64)
    cfg = T.PaliGemmaConfig(text_config=text, vision_config=vis, image_token_index=120, projection_dim=64)
    return T.PaliGemmaForConditionalGeneration(cfg)


def llama4():
    text = T.Llama4TextConfig(**S, intermediate_size_mlp=128, num_local_experts=2, attention_chunk_size=8,
                              no_rope_layers=[1, 0], initializer_range=0.25)
    vis = T.Llama4VisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                               image_size=28, patch_size=14, vision_output_dim=32, projector_input_dim=32,
                               projector_output_dim=32)
    cfg = T.Llama4Config(text_config=text, vision_config=vis, image_token_index=120, boi_token_index=121,
                         eoi_token_index=122)
    return T.Llama4ForConditionalGeneration(cfg)


def llama4_nochunk():  # attention_chunk_size=None: all full attention (NoPE layer + temperature tuning)
    text = T.Llama4TextConfig(**S, intermediate_size_mlp=128, num_local_experts=2, attention_chunk_size=None,
                              no_rope_layers=[1, 0], initializer_range=0.25)
    vis = T.Llama4VisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                               image_size=28, patch_size=14, vision_output_dim=32, projector_input_dim=32,
                               projector_output_dim=32)
    cfg = T.Llama4Config(text_config=text, vision_config=vis, image_token_index=120)
    return T.Llama4ForConditionalGeneration(cfg)


def mllama_cross():
    text = T.MllamaTextConfig(**{**S, "num_hidden_layers": 3}, cross_attention_layers=[1], initializer_range=0.25)
    vis = T.MllamaVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_global_layers=1,
                               attention_heads=2, image_size=28, patch_size=14, vision_output_dim=64,
                               intermediate_layers_indices=[0])
    cfg = T.MllamaConfig(text_config=text, vision_config=vis, image_token_index=120)
    return T.MllamaForConditionalGeneration(cfg)


def lfm2_vl_conv():
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING
    cfg = CONFIG_MAPPING["lfm2_vl"]()
    t = cfg.text_config
    for k, v in S.items():
        setattr(t, k, v)
    t.layer_types = ["conv", "full_attention"]
    t.initializer_range = 0.25
    shrink_sub(cfg.vision_config, t)
    cfg = type(cfg).from_dict(cfg.to_dict())
    return T.Lfm2VlForConditionalGeneration(cfg)


def _small_gemma3n_text(**kw):
    return T.Gemma3nTextConfig(
        **{**S, "num_hidden_layers": 4}, layer_types=["sliding_attention", "full_attention"] * 2, sliding_window=8,
        num_kv_shared_layers=2, activation_sparsity_pattern=[0.95, 0.0, 0.0, 0.0], hidden_size_per_layer_input=16,
        vocab_size_per_layer_input=128, laurel_rank=8, altup_num_inputs=4, initializer_range=0.02, **kw)


class _Stub(torch.nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.lin = torch.nn.Linear(4, 4)


def gemma3n():
    import transformers.models.gemma3n.modeling_gemma3n as G
    text = _small_gemma3n_text()
    audio = T.Gemma3nAudioConfig(hidden_size=32, conf_num_attention_heads=2, conf_num_hidden_layers=1,
                                 sscp_conv_channel_size=[8, 8], vocab_size=16)
    vis = T.Gemma3nVisionConfig(hidden_size=32, vocab_size=16)
    cfg = T.Gemma3nConfig(text_config=text, audio_config=audio, vision_config=vis, image_token_id=120,
                          audio_token_id=121, boi_token_id=122, eoi_token_id=123, boa_token_id=124,
                          eoa_token_id=125)
    real = G.AutoModel.from_config

    def from_config(c, *a, **k):
        if isinstance(c, T.Gemma3nVisionConfig):  # timm is not installed; text-only prompts never reach it
            return _Stub(c)
        return real(c, *a, **k)

    G.AutoModel.from_config = from_config
    try:
        return T.Gemma3nForConditionalGeneration(cfg)
    finally:
        G.AutoModel.from_config = real


def gemma3n_causal():
    return T.Gemma3nForCausalLM(_small_gemma3n_text())


def phi4mm():
    cfg = T.Phi4MultimodalConfig(**{k: v for k, v in S.items() if k != "head_dim"}, initializer_range=0.25,
                                 vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                                    num_attention_heads=2, image_size=28, patch_size=14,
                                                    crop_size=28),
                                 audio_config=dict(hidden_size=32, intermediate_size=64, num_blocks=1,
                                                   num_attention_heads=2, nemo_conv_channels=8,
                                                   downsample_rate=1))
    return T.Phi4MultimodalForCausalLM(cfg)


def smolvlm():
    text = T.LlamaConfig(**S, initializer_range=0.25)
    vis = T.SmolVLMVisionConfig(**V, image_size=28, patch_size=14)
    cfg = T.SmolVLMConfig(text_config=text, vision_config=vis, image_token_id=120, scale_factor=1)
    return T.SmolVLMForConditionalGeneration(cfg)


def kosmos2_5():
    from run_one import build
    return build("kosmos-2.5")


def kosmos2():
    text = T.Kosmos2TextConfig(vocab_size=128, embed_dim=64, layers=2, attention_heads=4, ffn_dim=128,
                               max_position_embeddings=512, pad_token_id=1, bos_token_id=0, eos_token_id=2,
                               init_std=0.25)
    vis = T.Kosmos2VisionConfig(**V, image_size=28, patch_size=14)
    cfg = T.Kosmos2Config(text_config=text.to_dict(), vision_config=vis.to_dict(), latent_query_num=4)
    return T.Kosmos2ForConditionalGeneration(cfg)


def xglm():
    cfg = T.XGLMConfig(vocab_size=128, d_model=64, num_layers=2, attention_heads=4, ffn_dim=128,
                       max_position_embeddings=512, init_std=0.25, pad_token_id=1, bos_token_id=0, eos_token_id=2)
    return T.XGLMForCausalLM(cfg)


def qwen2_vl_sliding():  # Qwen2-VL text with use_sliding_window / max_window_layers
    from run_one import build
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING
    cfg = CONFIG_MAPPING["qwen2_vl"]()
    t = cfg.text_config
    for k, v in S.items():
        setattr(t, k, v)
    t.rope_parameters["mrope_section"] = [2, 3, 3]
    t.use_sliding_window, t.sliding_window, t.max_window_layers = True, 8, 1
    t.layer_types = ["full_attention", "sliding_attention"]
    t.initializer_range = 0.25
    shrink_sub(cfg.vision_config, t)
    cfg = type(cfg).from_dict(cfg.to_dict())
    return T.Qwen2VLForConditionalGeneration(cfg)


def _generic(model_type, fix):
    import run_one
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING
    real = run_one.shrink_text

    def patched(cfg):
        real(cfg)
        fix(cfg)
    run_one.shrink_text = patched
    try:
        return run_one.build(model_type)
    finally:
        run_one.shrink_text = real


def glm4v_moe():
    def fix(t):
        t.rope_parameters["mrope_section"] = [1, 1, 2]
    return _generic("glm4v_moe", fix)


def ernie4_5_vl_moe():
    import run_one
    run_one.MOE.pop("moe_intermediate_size")
    def fix(t):
        t.moe_intermediate_size = [64, 64]
        t.moe_num_experts = 4
        t.rope_parameters["mrope_section"] = [3, 3, 2]
    return _generic("ernie4_5_vl_moe", fix)
