"""Import (and export) Hugging Face safetensors checkpoints.

Cornstarch §3 builds an MLLM from pretrained unimodal models (a Hugging Face LLM, a CLIP /
SigLIP vision tower, a Whisper encoder) plus new projectors; this package puts such
checkpoints into mmjax's NNX modules and writes trained ones back.

- `checkpoint`: safetensors headers / lazy reads, the HF-name tables (`Entry`), export.
- `llm`, `llm_config`: Llama / Mistral / Qwen2 / Qwen3 / Gemma 2 / Gemma 3 / Phi-3 decoders
  (both config layouts, linear / llama3 / yarn RoPE, sliding windows).
- `vision`: CLIP / SigLIP vision towers (`models.vit.StandardViT`).
- `whisper`: the Whisper encoder (`models.audio.AudioEncoder`).
- `vae`: diffusers' AutoencoderKL (`models.vae.AutoencoderKL`, the generator's frozen VAE).
- `qwen2_vl`: whole Qwen2-VL / Qwen2.5-VL checkpoints <-> `MultimodalModel` (both layouts;
  `qwen2_vl_forward`: transformers' forward on it);
  `qwen2_vl_pretrained`: such a checkpoint as the pretrained LLM / tower of a training run.
- `llava`: whole LlavaForConditionalGeneration checkpoints <-> `MultimodalModel`
  (`llava_layouts`: transformers 4 / 5 layouts; `llava_forward`: transformers' forward).
- `write_back`: a unit written back over the checkpoint it came from.
- `dispatch`: `load(path) -> (module, config)`, `hf_forward(module, **hf_inputs)`,
  `save(module, config, out_dir)` (every kind `load` accepts).
- `generation`: `generate(module, max_new_tokens=N, **hf_inputs) -> [batch, <= N]` new token
  ids, greedy, as transformers' `generate(do_sample=False)` (left padding via
  attention_mask; rows padded with pad_token_id after their eos, stopping once all rows
  have; docs/guide.md).
- `peft`, `peft_names`: peft LoRA adapters in (`load(path, adapter=DIR)`) and out
  (`save_adapter(module, config, out_dir)`).
- `pretrained`: loading checkpoints into a `MultimodalModel` or pipeline stages.
"""
from mmjax.models.hf.checkpoint import (INDEX_NAME, Checkpoint, Entry, apply_to_module,
                                        load_entries, read_config, save_entries)
from mmjax.models.hf.dispatch import (build_module, config_for, hf_forward, load, load_pure,
                                      model_type, save)
from mmjax.models.hf.generation import generate
from mmjax.models.hf.llava import (is_llava, llava_config_from_hf, llava_config_to_hf,
                                   llava_load_plan, load_llava, save_llava)
from mmjax.models.hf.llm import (config_from_hf, config_to_hf, export_llm_safetensors,
                                 llm_entries, load_llm_safetensors, rope_from_hf)
from mmjax.models.hf.peft import apply_adapter, save_adapter
from mmjax.models.hf.pretrained import (PretrainedError, check_pretrained, expand_whole_model,
                                        load_into_model,
                                        load_plan, load_stage_state, prepare_pretrained,
                                        pretrained_config)
from mmjax.models.hf.qwen2_vl import (load_qwen2_vl, qwen2_vl_config_from_hf,
                                      qwen2_vl_config_to_hf, qwen2_vl_entries, save_qwen2_vl)
from mmjax.models.hf.vision import (export_vit_safetensors, load_vit_safetensors,
                                    vision_config_from_hf, vision_config_to_hf, vit_entries)
from mmjax.models.hf.whisper import (audio_config_from_hf, audio_config_to_hf,
                                     export_whisper_encoder_safetensors,
                                     load_whisper_encoder_safetensors, whisper_entries)
from mmjax.models.hf.vae import (export_vae_safetensors, load_vae_safetensors,
                                 vae_config_from_hf, vae_config_to_hf, vae_entries)
