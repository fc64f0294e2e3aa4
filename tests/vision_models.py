"""Tiny vision-language checkpoints and media files built inside the tests (no hub, a few seconds each)."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch
from PIL import Image
from transformers import AutoConfig, GenerationConfig, InternVLForConditionalGeneration, Qwen2_5_VLForConditionalGeneration

from family_models import family_tokenizer
from tiny_models import make_tiny_tokenizer
from twinkle_core.data import get_chat_template
from twinkle_core.hub.internvl import write_processor_settings

PATCH, MERGE = 14, 2
PIXELS = (56 * 56, 56 * 56)  # min/max pixels: a 56x56 image is 4x4 patches, 4 merged tokens


def write_image(path: Path, colour=(255, 0, 0), size=(56, 56), seed: int | None = None) -> Path:
    """A PNG of one colour, or random pixels with `seed`."""
    path.parent.mkdir(parents=True, exist_ok=True)
    if seed is None:
        Image.new("RGB", size, colour).save(path)
    else:
        pixels = np.random.default_rng(seed).integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)
        Image.fromarray(pixels).save(path)
    return path


def write_video(path: Path, frames: int = 8, fps: int = 4, size=(56, 56), seed: int = 0) -> Path:
    """A short MPEG-4 video of random frames (PyAV)."""
    import av

    path.parent.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    with av.open(str(path), "w") as container:
        stream = container.add_stream("mpeg4", rate=fps)
        stream.width, stream.height, stream.pix_fmt = size[0], size[1], "yuv420p"
        for _ in range(frames):
            pixels = rng.integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)
            container.mux(stream.encode(av.VideoFrame.from_ndarray(pixels, format="rgb24")))
        container.mux(stream.encode())
    return path


def qwen_vl_tokenizer():
    """The Qwen 2.5 tiny tokenizer (it has the vision tokens) with the Qwen 2.5 chat template."""
    return family_tokenizer("qwen2_5", get_chat_template("qwen2_5"))


def tiny_qwen2_5_vl(tokenizer, seed: int = 0) -> Qwen2_5_VLForConditionalGeneration:
    """A random Qwen2.5-VL of the real class: 2 text layers (hidden 64), a 1-block vision tower, real M-RoPE."""
    tid = tokenizer.convert_tokens_to_ids
    config = AutoConfig.for_model(
        "qwen2_5_vl",
        text_config=dict(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False,
                         bos_token_id=tid("<|endoftext|>"), eos_token_id=tid("<|im_end|>"),
                         pad_token_id=tid("<|endoftext|>"),
                         rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0,
                                          "mrope_section": [2, 3, 3]}),  # head_dim 16: 8 rotary pairs
        vision_config=dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64,
                           patch_size=PATCH, spatial_merge_size=MERGE, temporal_patch_size=2, window_size=56,
                           fullatt_block_indexes=[0], tokens_per_second=2),
        image_token_id=tid("<|image_pad|>"), video_token_id=tid("<|video_pad|>"),
        vision_start_token_id=tid("<|vision_start|>"), vision_end_token_id=tid("<|vision_end|>"),
    )
    torch.manual_seed(seed)
    model = Qwen2_5_VLForConditionalGeneration(config)
    model.generation_config = GenerationConfig(eos_token_id=[tid("<|im_end|>")], pad_token_id=tid("<|endoftext|>"))
    return model


def save_tiny_qwen2_5_vl(directory: Path, seed: int = 0) -> Path:
    """A downloaded-looking Qwen2.5-VL directory: config, safetensors, tokenizer, preprocessor_config.json."""
    tokenizer = qwen_vl_tokenizer()
    tiny_qwen2_5_vl(tokenizer, seed).save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    (Path(directory) / "preprocessor_config.json").write_text(json.dumps({
        "image_processor_type": "Qwen2VLImageProcessor", "patch_size": PATCH, "merge_size": MERGE,
        "temporal_patch_size": 2, "min_pixels": PIXELS[0], "max_pixels": PIXELS[1],
        "image_mean": [0.48145466, 0.4578275, 0.40821073], "image_std": [0.26862954, 0.26130258, 0.27577711]}))
    return Path(directory)


INTERNVL_TOKENS = ["<img>", "</img>", "<IMG_CONTEXT>"]
TILE = 56  # a tile is 4x4 patches of 14, pixel-shuffled to 2x2: 4 context tokens per tile


def internvl_tokenizer():
    """A ChatML tokenizer with InternVL's image tokens."""
    return make_tiny_tokenizer(extra_special_tokens=INTERNVL_TOKENS)


def save_tiny_internvl(directory: Path, seed: int = 0) -> Path:
    """A transformers-native InternVL directory: a 2-layer Qwen2 language model, a 1-layer InternViT, 56-pixel
    tiles (at most 4 and a thumbnail), preprocessor_config.json."""
    tokenizer = internvl_tokenizer()
    tid = tokenizer.convert_tokens_to_ids
    config = AutoConfig.for_model(
        "internvl",
        text_config=dict(model_type="qwen2", vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id),
        vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                           image_size=TILE, patch_size=PATCH),
        image_token_id=tid("<IMG_CONTEXT>"), image_seq_length=4, downsample_ratio=0.5)
    torch.manual_seed(seed)
    InternVLForConditionalGeneration(config).save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    (Path(directory) / "preprocessor_config.json").write_text(json.dumps({
        "image_processor_type": "GotOcr2ImageProcessor", "size": {"height": TILE, "width": TILE},
        "crop_to_patches": True, "min_patches": 1, "max_patches": 4,
        "image_mean": [0.485, 0.456, 0.406], "image_std": [0.229, 0.224, 0.225]}))  # InternVL's (ImageNet)
    write_processor_settings(Path(directory), config.image_seq_length)  # as a -hf checkpoint has them
    return Path(directory)


PATCH3 = 16  # Qwen3-VL and Qwen 3.5 checkpoints use 16-pixel patches: a 64x64 image is 4x4 patches, 4 tokens
PIXELS3 = (64 * 64, 64 * 64)


def _qwen3_preprocessor(directory: Path) -> None:
    """Image and video settings as Qwen3-VL checkpoints ship them; the video budget counts the whole clip
    (frames x height x width): up to 8 frames of 64x64 keep their size."""
    settings = {"patch_size": PATCH3, "merge_size": MERGE, "temporal_patch_size": 2,
                "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5]}
    (Path(directory) / "preprocessor_config.json").write_text(json.dumps({
        "image_processor_type": "Qwen2VLImageProcessor", **settings,
        "size": {"shortest_edge": PIXELS3[0], "longest_edge": PIXELS3[1]}}))
    (Path(directory) / "video_preprocessor_config.json").write_text(json.dumps({
        "video_processor_type": "Qwen3VLVideoProcessor", **settings,
        "size": {"shortest_edge": PIXELS3[0], "longest_edge": 8 * 64 * 64}}))


def save_tiny_qwen3_vl(directory: Path, seed: int = 0) -> Path:
    """A Qwen3-VL directory of the real class: 2 text layers (hidden 64, head 16, interleaved M-RoPE), a 1-block
    vision tower with one DeepStack merger, 16-pixel patches, preprocessor_config.json."""
    from transformers import Qwen3VLForConditionalGeneration

    tokenizer = family_tokenizer("qwen3", get_chat_template("chatml"))
    tid = tokenizer.convert_tokens_to_ids
    config = AutoConfig.for_model(
        "qwen3_vl",
        text_config=dict(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16, tie_word_embeddings=False,
                         bos_token_id=tid("<|endoftext|>"), eos_token_id=tid("<|im_end|>"),
                         pad_token_id=tid("<|endoftext|>"),
                         rope_parameters={"rope_type": "default", "rope_theta": 5_000_000.0,
                                          "mrope_section": [4, 2, 2], "mrope_interleaved": True}),
        vision_config=dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64,
                           patch_size=PATCH3, spatial_merge_size=MERGE, temporal_patch_size=2,
                           num_position_embeddings=64, deepstack_visual_indexes=[0]),
        image_token_id=tid("<|image_pad|>"), video_token_id=tid("<|video_pad|>"),
        vision_start_token_id=tid("<|vision_start|>"), vision_end_token_id=tid("<|vision_end|>"),
        tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    model = Qwen3VLForConditionalGeneration(config)
    model.generation_config = GenerationConfig(eos_token_id=[tid("<|im_end|>")], pad_token_id=tid("<|endoftext|>"))
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    _qwen3_preprocessor(directory)
    return Path(directory)


def save_tiny_qwen3_5_vl(directory: Path) -> Path:
    """The tiny top-level `qwen3_5` checkpoint of the Qwen 3.5 family tests (gated-delta-net + gated attention
    layers, a 1-block vision tower), with a preprocessor_config.json: the Qwen 3.5 VL model of that checkpoint."""
    from family_models import save_tiny_family_model

    save_tiny_family_model("qwen3_5", directory)
    _qwen3_preprocessor(directory)
    return Path(directory)


# --- OpenGVLab's original (remote-code) InternVL layout, written from a native model ---------------------------

INTERNVL_CHAT_CODE = ("configuration_internvl_chat", "modeling_internvl_chat", "configuration_intern_vit",
                      "modeling_intern_vit", "conversation")
_LLAMA_TO_INTERNLM2 = {  # Llama name part -> InternLM2 name part (q/k/v are packed into wqkv, gate/up stay w1/w3)
    "model.embed_tokens.": "model.tok_embeddings.", ".self_attn.o_proj.": ".attention.wo.",
    ".mlp.gate_proj.": ".feed_forward.w1.", ".mlp.up_proj.": ".feed_forward.w3.",
    ".mlp.down_proj.": ".feed_forward.w2.", ".input_layernorm.": ".attention_norm.",
    ".post_attention_layernorm.": ".ffn_norm.",
}
_NATIVE_TO_INTERNVIT = {  # native vision/projector name part -> the original's
    "model.vision_tower.embeddings.cls_token": "vision_model.embeddings.class_embedding",
    "model.vision_tower.embeddings.position_embeddings": "vision_model.embeddings.position_embedding",
    "model.vision_tower.embeddings.patch_embeddings.projection.": "vision_model.embeddings.patch_embedding.",
    "model.vision_tower.encoder.layer.": "vision_model.encoder.layers.",
    ".attention.projection_layer.": ".attn.proj.", ".attention.q_norm.": ".attn.q_norm.",
    ".attention.k_norm.": ".attn.k_norm.", ".lambda_1": ".ls1", ".lambda_2": ".ls2",
    ".layernorm_before.": ".norm1.", ".layernorm_after.": ".norm2.",
    "model.multi_modal_projector.layer_norm.": "mlp1.0.", "model.multi_modal_projector.linear_1.": "mlp1.1.",
    "model.multi_modal_projector.linear_2.": "mlp1.3.",
}


def tiny_native_internvl(text: str = "llama", seed: int = 0, qk_norm: bool = False, tied: bool = False):
    """A random native InternVL whose parts have an original counterpart: a 2-layer Llama (InternLM2's
    architecture, no biases) or Qwen2 language model, a 1-layer InternViT with a qkv bias (qk-norm and RMSNorm,
    as InternViT-6B, with `qk_norm`), untied embeddings unless `tied`, 56-pixel tiles."""
    from transformers import InternVLForConditionalGeneration

    tokenizer = internvl_tokenizer()
    text_config = dict(model_type=text, vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128,
                       num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-6,
                       max_position_embeddings=512, tie_word_embeddings=tied, bos_token_id=tokenizer.bos_token_id,
                       eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    if text == "llama":
        text_config.update(attention_bias=False, mlp_bias=False, rope_parameters={"rope_type": "default",
                                                                                  "rope_theta": 10000.0})
    config = AutoConfig.for_model(
        "internvl", text_config=text_config,
        vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                           image_size=TILE, patch_size=PATCH, attention_bias=True, use_qk_norm=qk_norm,
                           norm_type="rms_norm" if qk_norm else "layer_norm"),
        image_token_id=tokenizer.convert_tokens_to_ids("<IMG_CONTEXT>"), image_seq_length=4, downsample_ratio=0.5,
        tie_word_embeddings=tied)
    torch.manual_seed(seed)
    model = InternVLForConditionalGeneration(config).eval()
    with torch.no_grad():  # random layer scales, norms and biases, so a wrong mapping cannot hide behind 1s and 0s
        for name, param in model.named_parameters():
            if "norm" in name or "lambda" in name or name.endswith("bias"):
                param.copy_(torch.randn_like(param) * 0.1 + (1.0 if name.endswith("weight") else 0.0))
    return model, tokenizer


def _pack_wqkv(q, k, v, kv_heads: int):
    head_dim = k.shape[0] // kv_heads
    rest = q.shape[1:]
    return torch.cat([q.reshape(kv_heads, -1, head_dim, *rest), k.reshape(kv_heads, 1, head_dim, *rest),
                      v.reshape(kv_heads, 1, head_dim, *rest)], dim=1).reshape(-1, *rest)


def internvl_chat_state_dict(model) -> dict[str, torch.Tensor]:
    """The native model's tensors under the original names (InternLM2 language model for a Llama one)."""
    state, out = model.state_dict(), {}
    internlm2 = model.config.text_config.model_type == "llama"
    kv_heads = model.config.text_config.num_key_value_heads
    for name, tensor in state.items():
        if name.startswith("model.language_model.") or name == "lm_head.weight":
            llm = "model." + name.removeprefix("model.language_model.") if name != "lm_head.weight" else name
            if internlm2:
                if ".self_attn.q_proj." in llm:
                    prefix, kind = name.split(".self_attn.q_proj.")
                    packed = _pack_wqkv(*(state[f"{prefix}.self_attn.{p}_proj.{kind}"] for p in "qkv"), kv_heads)
                    out["language_model." + llm.replace(".self_attn.q_proj.", ".attention.wqkv.")] = packed.clone()
                    continue
                if ".self_attn.k_proj." in llm or ".self_attn.v_proj." in llm:
                    continue
                llm = "output.weight" if llm == "lm_head.weight" else llm
                for part, original in _LLAMA_TO_INTERNLM2.items():
                    llm = llm.replace(part, original)
            out["language_model." + llm] = tensor.clone()
            continue
        if ".attention.k_proj." in name or ".attention.v_proj." in name:
            continue
        if ".attention.q_proj." in name:
            prefix, kind = name.split(".attention.q_proj.")
            name = f"{prefix}.attn.qkv.{kind}"
            tensor = torch.cat([state[f"{prefix}.attention.{p}_proj.{kind}"] for p in "qkv"])
        for part, original in _NATIVE_TO_INTERNVIT.items():
            name = name.replace(part, original)
        out[name] = tensor.clone()
    return out


def write_internvl_chat(folder: Path, model, tokenizer, llm_architecture: str | None = None) -> Path:
    """An OpenGVLab-layout InternVL directory (`internvl_chat` config with llm_config and vision_config,
    safetensors under the original names, a tokenizer, remote code that must never run) from a native model."""
    from safetensors.torch import save_file

    folder.mkdir(parents=True)
    save_file(internvl_chat_state_dict(model), folder / "model.safetensors", metadata={"format": "pt"})
    tc, vc = model.config.text_config, model.config.vision_config
    llm = {"vocab_size": tc.vocab_size, "hidden_size": tc.hidden_size, "intermediate_size": tc.intermediate_size,
           "num_hidden_layers": tc.num_hidden_layers, "num_attention_heads": tc.num_attention_heads,
           "num_key_value_heads": tc.num_key_value_heads, "hidden_act": "silu", "rms_norm_eps": tc.rms_norm_eps,
           "max_position_embeddings": tc.max_position_embeddings, "rope_theta": tc.rope_parameters["rope_theta"],
           "tie_word_embeddings": model.config.tie_word_embeddings, "bos_token_id": tc.bos_token_id, "eos_token_id": tc.eos_token_id,
           "pad_token_id": tc.pad_token_id, "torch_dtype": "float32"}
    if tc.model_type == "llama":
        llm.update(architectures=["InternLM2ForCausalLM"], model_type="internlm2", bias=False, rope_scaling=None,
                   attn_implementation="eager",
                   auto_map={"AutoConfig": "configuration_internlm2.InternLM2Config",
                             "AutoModelForCausalLM": "modeling_internlm2.InternLM2ForCausalLM"})
    else:
        llm.update(architectures=["Qwen2ForCausalLM"], model_type="qwen2", use_sliding_window=False)
    if llm_architecture:
        llm["architectures"] = [llm_architecture]
    vision = {"architectures": ["InternVisionModel"], "model_type": "intern_vit_6b", "hidden_size": vc.hidden_size,
              "intermediate_size": vc.intermediate_size, "num_hidden_layers": vc.num_hidden_layers,
              "num_attention_heads": vc.num_attention_heads, "image_size": vc.image_size[0],
              "patch_size": vc.patch_size[0], "qkv_bias": vc.attention_bias, "qk_normalization": vc.use_qk_norm,
              "norm_type": vc.norm_type, "hidden_act": "gelu", "layer_norm_eps": vc.layer_norm_eps,
              "initializer_factor": 0.1, "dropout": 0.0, "attention_dropout": 0.0, "drop_path_rate": 0.0,
              "use_flash_attn": False}
    config = {
        "architectures": ["InternVLChatModel"], "model_type": "internvl_chat", "torch_dtype": "float32",
        "auto_map": {"AutoConfig": "configuration_internvl_chat.InternVLChatConfig",
                     "AutoModel": "modeling_internvl_chat.InternVLChatModel"},
        "downsample_ratio": model.config.downsample_ratio, "dynamic_image_size": True, "force_image_size": TILE,
        "max_dynamic_patch": 4, "min_dynamic_patch": 1, "ps_version": "v2", "select_layer": -1,
        "template": "internlm2-chat", "use_thumbnail": True, "llm_config": llm, "vision_config": vision,
    }
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [tc.eos_token_id]}))
    for module in INTERNVL_CHAT_CODE:
        (folder / f"{module}.py").write_text("raise RuntimeError('InternVL remote code was executed')\n")
    tokenizer.save_pretrained(folder)
    settings = json.loads((folder / "tokenizer_config.json").read_text())
    settings.update(tokenizer_class="InternLM2Tokenizer",
                    auto_map={"AutoTokenizer": ["tokenization_internlm2.InternLM2Tokenizer", None]})
    (folder / "tokenizer_config.json").write_text(json.dumps(settings, indent=2))
    return folder


# --- the four families side by side (tests/models/test_vision_model.py, test_vision_packing.py) ---------------

COLOURS = {"red": (255, 0, 0), "green": (0, 255, 0), "blue": (0, 0, 255), "white": (255, 255, 255)}
# family: (builder, image side in pixels, rows with a video)
VL_FAMILIES = {"qwen2_5_vl": (save_tiny_qwen2_5_vl, 56, True), "qwen3_vl": (save_tiny_qwen3_vl, 64, True),
               "qwen3_5_vl": (save_tiny_qwen3_5_vl, 64, True), "internvl2_5": (save_tiny_internvl, 56, False)}


def family_rows(folder: Path, side: int, video: bool) -> list[dict]:
    """Two one-colour image chats of `side` pixels, and a chat with a 4-frame video where the family reads one."""
    rows = [{"messages": [{"role": "user", "content": "<image>What colour is it?"},
                          {"role": "assistant", "content": f"It is {name}."}],
             "images": [str(write_image(folder / f"{name}.png", COLOURS[name], size=(side, side)))]}
            for name in ("red", "blue")]
    if video:
        clip = write_video(folder / "clip.mp4", frames=4, fps=4, size=(side, side))
        rows.append({"messages": [{"role": "user", "content": "<video>What moves?"},
                                  {"role": "assistant", "content": "Noise."}], "videos": [str(clip)]})
    return rows
