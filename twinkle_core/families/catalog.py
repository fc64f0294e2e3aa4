"""The model families of the specification (../shared/MODELS.md), one entry each."""
from __future__ import annotations

from twinkle_core.families.registry import ModelFamily, VisionParts, register_family

CHATML_END = ("<|im_end|>",)
DEEPSEEK_END = ("<｜end▁of▁sentence｜>",)

register_family(ModelFamily(
    name="qwen3_5", title="Qwen 3.5", model_ids="Qwen/Qwen3.5-0.6B ~ Qwen/Qwen3.5-235B-A22B",
    model_types=("qwen3_5", "qwen3_5_text", "qwen3_5_moe", "qwen3_5_moe_text"),
    moe_model_types=("qwen3_5_moe", "qwen3_5_moe_text"),
    id_pattern=r"^qwen/qwen3\.5-(?!vl)", chat_template="qwen3_5", end_of_turn=CHATML_END, thinking=True,
    notes="hybrid gated-delta-net / full attention; thinking mode. Not on Megatron: megatron-core 0.16's "
          "gated-delta-net layers exist only in an experimental spec that needs Transformer Engine and the "
          "fla kernels (CUDA), and its GPTModel has no output-gated attention",
))
register_family(ModelFamily(
    name="qwen3", title="Qwen 3", model_ids="Qwen/Qwen3-0.6B ~ Qwen/Qwen3-235B-A22B",
    model_types=("qwen3", "qwen3_moe"), moe_model_types=("qwen3_moe",),
    id_pattern=r"^qwen/qwen3-(?!vl|embedding|reranker|next|coder|omni)", chat_template="qwen3", end_of_turn=CHATML_END,
    thinking=True, megatron=True,
    notes="dense (RMSNorm on each q/k head) and MoE (softmax top-k router, no shared expert); thinking mode. "
          "The 2507 Instruct/Thinking checkpoints ship their own templates, which are kept",
))
register_family(ModelFamily(
    name="qwen2_5", title="Qwen 2.5", model_ids="Qwen/Qwen2.5-0.5B ~ Qwen/Qwen2.5-72B", model_types=("qwen2",),
    id_pattern=r"^qwen/qwen2\.5-(?!vl)", chat_template="qwen2_5", end_of_turn=CHATML_END, megatron=True,
    notes="dense, qkv bias",
))
register_family(ModelFamily(
    name="deepseek_v4", title="DeepSeek V4", model_ids="deepseek-ai/DeepSeek-V4", model_types=("deepseek_v4",),
    moe_model_types=("deepseek_v4",), id_pattern=r"^deepseek-ai/deepseek-v4", chat_template="deepseek_v4",
    end_of_turn=DEEPSEEK_END, thinking=True,
    notes="685B MoE; DSML tool-call encoding. Not on Megatron: megatron-core 0.16 has no compressed sparse "
          "attention with a lightning indexer, hyper-connections, grouped low-rank output or hash routing",
    # o_a_proj subclasses nn.Linear but splits its input into groups: a plain LoRA wrapper breaks its shape.
    lora_exclude_modules=("o_a_proj",),
))
register_family(ModelFamily(
    name="deepseek_r1", title="DeepSeek R1", model_ids="deepseek-ai/DeepSeek-R1", model_types=("deepseek_v3",),
    moe_model_types=("deepseek_v3",), id_pattern=r"^deepseek-ai/deepseek-(r1|v3)", chat_template="deepseek_r1",
    end_of_turn=DEEPSEEK_END, thinking=True, megatron=True,
    notes="685B MoE (DeepSeek-V3 architecture, MLA); reasoning. The multi-token-prediction layer is not "
          "converted (Hugging Face does not load it either)",
))
register_family(ModelFamily(
    name="llama3", title="Llama 3", model_ids="meta-llama/Llama-3.3-70B-Instruct (8B–70B)", model_types=("llama",),
    id_pattern=r"^meta-llama/(meta-)?llama-3", chat_template="llama3", end_of_turn=("<|eot_id|>", "<|eom_id|>"),
    megatron=True, notes="dense",
))
register_family(ModelFamily(
    name="mistral", title="Mistral", model_ids="mistralai/Mistral-7B-v0.3", model_types=("mistral",),
    id_pattern=r"^mistralai/mistral-", chat_template="mistral", end_of_turn=("</s>",), megatron=True,
    notes="dense; system prompt rides on the last user turn",
))
register_family(ModelFamily(
    name="yi", title="Yi", model_ids="01-ai/Yi-1.5-34B (6B–34B)", model_types=("llama",),
    id_pattern=r"^01-ai/yi-", chat_template="yi", end_of_turn=CHATML_END, megatron=True, tools=False,
    default_for_model_type=False, notes="Llama architecture",
))
register_family(ModelFamily(
    name="glm4", title="GLM-4", model_ids="THUDM/glm-4-9b-chat", model_types=("glm4",),
    id_pattern=r"^(thudm|zai-org)/glm-4", chat_template="glm4",
    end_of_turn=("<|user|>", "<|observation|>", "<|endoftext|>"),
    notes="dense; a turn ends at the next role token. Not on Megatron: its sandwich norms (a norm after "
          "attention and after the MLP) have no place in megatron-core 0.16's TransformerLayer",
))
register_family(ModelFamily(
    name="internlm2_5", title="InternLM 2.5", model_ids="internlm/internlm2_5-7b-chat (7B–20B)",
    model_types=("internlm2",), id_pattern=r"^internlm/internlm2(_5|\.5)?-", chat_template="internlm2",
    end_of_turn=CHATML_END, megatron=True,
    notes="converted to the Llama layout on download; no remote code runs",
))

# ----- embedding models (the embedding flow: InfoNCE, twinkle_core.objectives.embedding) -------------------
register_family(ModelFamily(
    name="qwen3_embedding", title="Qwen3-Embedding", model_ids="Qwen/Qwen3-Embedding-0.6B ~ 8B",
    model_types=("qwen3",), id_pattern=r"^qwen/qwen3-embedding", chat_template=None, end_of_turn=(),
    thinking=False, tools=False, default_for_model_type=False, pooling="last",
    query_prompt="Instruct: {task}\nQuery:",
    query_task="Given a web search query, retrieve relevant passages that answer the query",
    notes="a Qwen3 decoder read at its last token (each text ends with EOS); the instruction goes on queries only",
))
register_family(ModelFamily(
    name="bert_embedding", title="GTE / BERT encoders", model_ids="thenlper/gte-large-zh, all-MiniLM-L6-v2",
    model_types=("bert",), id_pattern=r"^(thenlper/gte-|sentence-transformers/|baai/bge-)", chat_template=None,
    end_of_turn=(), tools=False, pooling="cls", lora_exclude_modules=("pooler.dense",),
    notes="BertModel encoders: CLS pooling as gte-large-zh's card (a checkpoint's 1_Pooling config wins, e.g. "
          "mean for all-MiniLM-L6-v2); BERT's pooler head is not part of the embedding and stays frozen",
))
register_family(ModelFamily(
    name="gte", title="GTE (new, RoPE)", model_ids="Alibaba-NLP/gte-multilingual-base, gte-modernbert",
    model_types=("gte",), id_pattern=r"^alibaba-nlp/gte-", chat_template=None, end_of_turn=(), tools=False,
    pooling="cls", notes="transformers' native `gte` encoder (rotary positions); CLS pooling",
))

# ----- vision-language models (the vision_lm objective: twinkle_core.objectives.vision) --------------------
register_family(ModelFamily(
    name="qwen2_5_vl", title="Qwen 2.5 VL", model_ids="Qwen/Qwen2.5-VL-7B-Instruct", model_types=("qwen2_5_vl",),
    id_pattern=r"^qwen/qwen2\.5-vl-", chat_template="qwen2_5", end_of_turn=CHATML_END, tools=False,
    vision=VisionParts(vision_tower=("model.visual",), aligner=("model.visual.merger",),
                       language_model=("model.language_model", "lm_head")),
    notes="images (video rows encode too); 3-D M-RoPE positions from mm_token_type_ids; the stock processor "
          "needs torchvision, so images go through transformers' PIL image processor and video frames "
          "(PyAV) through our patchify",
))
register_family(ModelFamily(
    name="internvl2_5", title="InternVL 2.5",
    model_ids="OpenGVLab/InternVL2_5-8B (and the transformers-native `-hf` form)",
    model_types=("internvl",), id_pattern=r"^opengvlab/internvl(2_5|3)-[^/]*$", chat_template="chatml",
    end_of_turn=CHATML_END, tools=False,
    vision=VisionParts(vision_tower=("model.vision_tower",), aligner=("model.multi_modal_projector",),
                       language_model=("model.language_model", "lm_head")),
    notes="images as tiles of the model's size (transformers' GotOcr2 PIL image processor, up to max_patches "
          "tiles plus a thumbnail); transformers' native `internvl` checkpoints; the original remote-code "
          "checkpoints (`internvl_chat`, InternLM2 / Qwen2 / Llama language model) are converted to that form "
          "on download",
))
register_family(ModelFamily(
    name="qwen3_5_vl", title="Qwen 3.5 VL", model_ids="Qwen/Qwen3.5-VL-3B ~ 72B", model_types=("qwen3_5",),
    id_pattern=r"^qwen/qwen3\.5-vl-", chat_template="qwen3_5", end_of_turn=CHATML_END, thinking=True, tools=False,
    default_for_model_type=False,
    vision=VisionParts(vision_tower=("model.visual",), aligner=("model.visual.merger",),
                       language_model=("model.language_model", "lm_head")),
    notes="images and videos; `Qwen3_5ForConditionalGeneration` (AutoModelForImageTextToText), the same "
          "`qwen3_5` checkpoint the text-only Qwen 3.5 family loads as a causal LM: a VL id or the vision_lm "
          "objective on a checkpoint with a vision_config picks this family. Needs mm_token_type_ids; videos "
          "are written frame group by frame group behind their timestamps, as the stock Qwen3-VL processor does",
))
register_family(ModelFamily(
    name="qwen3_vl", title="Qwen3-VL", model_ids="Qwen/Qwen3-VL-2B-Instruct ~ 32B", model_types=("qwen3_vl",),
    id_pattern=r"^qwen/qwen3-vl-", chat_template="chatml", end_of_turn=CHATML_END, tools=False,
    vision=VisionParts(vision_tower=("model.visual",),
                       aligner=("model.visual.merger", "model.visual.deepstack_merger_list"),
                       language_model=("model.language_model", "lm_head")),
    notes="images and videos (timestamped frame groups); its DeepStack mergers count as the aligner; needs "
          "mm_token_type_ids (transformers' PIL image processor and our patchify, as Qwen 2.5 VL)",
))
