"""Ultravox: a Whisper encoder (ModifiedWhisperEncoder, shorter-than-30 s input allowed) reads each
utterance's log-mel frames, masked from `audio_lens` (frames -> encoder frames via
_get_feat_extract_output_lengths, then an extended key mask); the projector stacks every
`stack_factor` encoder frames into one LLM embedding; `audio_token_len` = ceil(mel frames /
(2 * stack_factor)) placeholder ids (the eos id) are overwritten at `audio_token_start_idx`; a
Llama decoder reads the merged sequence with the text attention_mask. The collator pads the text
(right for training, left for batched inference, shifting audio_token_start_idx by the left pad)
and pads the mel features with zeros on the right; pad == eos.

Ported from fixie-ai/ultravox @648efe7f55510afff7adb45f076e904b3aba1d02:
  ultravox/model/ultravox_model.py       UltravoxModel.forward / _prepare_audio_embeds / _audio_iter /
                                         generate, StackAudioFrames, RMSNorm, SwiGLU,
                                         UltravoxProjector, ModifiedWhisperEncoder.forward
  ultravox/model/ultravox_processing.py  DataCollatorForSeq2SeqWithAudio, UltravoxProcessor.__call__
                                         and _chunk_and_pad_audio
  ultravox/model/ultravox_data_proc.py   UltravoxDataproc._process (LossMaskType.LAST_ASSISTANT)
  ultravox/inference/infer.py            LocalInference.infer_batch / _dataproc / _generate (greedy)
  ultravox/training/model_types.py       padding_side "right" for training, "left" for inference
Adapted to the installed transformers (5.x): WhisperEncoderLayer is called as (hidden, mask) and
ModuleUtilsMixin.get_extended_attention_mask (gone in 5.x) is written out as it was in 4.x.
Tiny WhisperConfig / LlamaConfig, a word-level tokenizer built in memory, float64; no downloads.
"""
import warnings

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
import transformers
import transformers.activations
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers.models.whisper import modeling_whisper as whisper

warnings.filterwarnings("ignore", category=FutureWarning)
torch.manual_seed(0)
np.random.seed(0)
DTYPE = torch.float64


# --------------------------------------------------------------------------- tokenizer
words = ("<unk> <s> </s> <|user|> <|assistant|> transcribe the audio please what did speaker say "
         "hello world good morning how are you today fine thanks yes no maybe it is raining").split()
tok = transformers.PreTrainedTokenizerFast(
    tokenizer_object=Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>")),
    unk_token="<unk>", bos_token="<s>", eos_token="</s>")
tok._tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
tok.pad_token = tok.eos_token
tok.chat_template = ("{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|> {{ m['content'] }} </s> {% endfor %}"
                     "{% if add_generation_prompt %}<|assistant|> {% endif %}")
EOS = tok.eos_token_id


# --------------------------------------------------------------------------- ultravox_config.py
class UltravoxConfig(transformers.PretrainedConfig):
    model_type = "ultravox"

    def __init__(self, audio_config=None, text_config=None, hidden_size=64, stack_factor=8,
                 norm_init=0.4, projector_act="swiglu", projector_ln_mid=False, **kwargs):
        self.audio_config = audio_config
        self.text_config = text_config
        self.hidden_size = hidden_size
        self.stack_factor = stack_factor
        self.norm_init = norm_init
        self.projector_act = projector_act
        self.projector_ln_mid = projector_ln_mid
        super().__init__(**kwargs)


# --------------------------------------------------------------------------- ultravox_model.py
class StackAudioFrames(nn.Module):
    def __init__(self, stack_factor: int = 8):
        super().__init__()
        self.stack_factor = stack_factor

    def forward(self, audio_embeds):
        B, T, C = audio_embeds.shape
        T_pad = (T + self.stack_factor - 1) // self.stack_factor * self.stack_factor
        audio_embeds = F.pad(audio_embeds, (0, 0, 0, T_pad - T))
        B, T, C = audio_embeds.shape
        audio_embeds = audio_embeds.view(B, T // self.stack_factor, C * self.stack_factor)
        return audio_embeds


class RMSNorm(transformers.models.llama.modeling_llama.LlamaRMSNorm):
    def __init__(self, hidden_size: int, init: float = 1, eps: float = 1e-6):
        super().__init__(hidden_size=hidden_size, eps=eps)
        self.weight.data.fill_(init)


class SwiGLU(nn.Module):
    def forward(self, x):
        x, gate = x.chunk(2, dim=-1)
        return F.silu(gate) * x


transformers.activations.ACT2FN["swiglu"] = SwiGLU


class UltravoxProjector(nn.Module):
    def __init__(self, config: UltravoxConfig):
        super().__init__()
        self.hidden_dim = config.hidden_size
        self._pad_and_stack = StackAudioFrames(config.stack_factor)
        dim_in = config.audio_config.hidden_size * config.stack_factor
        self.ln_pre = RMSNorm(dim_in, init=config.norm_init)
        self.linear_1 = nn.Linear(dim_in, self.hidden_dim, bias=False)
        dim_mid = self.hidden_dim
        self.act = transformers.activations.get_activation(config.projector_act)
        dim_mid = dim_mid // 2 if config.projector_act == "swiglu" else dim_mid
        dim_out = config.text_config.hidden_size
        self.linear_2 = nn.Linear(dim_mid, dim_out, bias=False)
        self.ln_mid = nn.Identity()
        self.ln_post = RMSNorm(dim_out, init=config.norm_init)

    def forward(self, audio_features):
        audio_features = self._pad_and_stack(audio_features)
        audio_features = self.ln_pre(audio_features)
        hidden_states = self.linear_1(audio_features)
        hidden_states = self.act(hidden_states)
        hidden_states = self.ln_mid(hidden_states)
        hidden_states = self.linear_2(hidden_states)
        hidden_states = self.ln_post(hidden_states)
        return hidden_states


def get_extended_attention_mask(attention_mask, dtype):
    # transformers 4.x ModuleUtilsMixin.get_extended_attention_mask for a 2-D mask, not a decoder
    extended_attention_mask = attention_mask[:, None, None, :]
    extended_attention_mask = extended_attention_mask.to(dtype=dtype)
    extended_attention_mask = (1.0 - extended_attention_mask) * torch.finfo(dtype).min
    return extended_attention_mask


class ModifiedWhisperEncoder(whisper.WhisperEncoder):
    base_model_prefix = "model.encoder"

    def __init__(self, config: transformers.WhisperConfig):
        super().__init__(config)
        self.config.is_decoder = False
        self.audio_streaming_mask = None  # init_latency_mask(None)

    @property
    def max_context_length(self):
        return self.config.max_source_positions * self.conv1.stride[0] * self.conv2.stride[0]

    def forward(self, input_features, audio_len=None):
        expected_seq_length = self.max_context_length
        if input_features.shape[-1] > expected_seq_length:
            raise ValueError("Whisper expects the mel input features to be of length "
                             f"{expected_seq_length} or less, but found {input_features.shape[-1]}.")
        inputs_embeds = nn.functional.gelu(self.conv1(input_features))
        inputs_embeds = nn.functional.gelu(self.conv2(inputs_embeds))
        inputs_embeds = inputs_embeds.permute(0, 2, 1)
        embed_pos = self.embed_positions.weight[: inputs_embeds.size(-2)]
        hidden_states = inputs_embeds + embed_pos
        hidden_states = nn.functional.dropout(hidden_states, p=self.dropout, training=self.training)

        attention_mask = None
        if audio_len is not None:
            audio_feature_len = self._get_feat_extract_output_lengths(audio_len)
            max_seq_len = hidden_states.shape[1]
            attention_mask = torch.arange(max_seq_len, device=hidden_states.device)[None, :].lt(
                audio_feature_len.view(-1, 1))
            attention_mask = get_extended_attention_mask(attention_mask, dtype=hidden_states.dtype)

        for idx, encoder_layer in enumerate(self.layers):
            hidden_states = encoder_layer(hidden_states, attention_mask)

        hidden_states = self.layer_norm(hidden_states)
        return transformers.modeling_outputs.BaseModelOutput(last_hidden_state=hidden_states)


class UltravoxModel(nn.Module):
    def __init__(self, config: UltravoxConfig):
        super().__init__()
        self.config = config
        self.audio_tower = ModifiedWhisperEncoder(config.audio_config)
        self.multi_modal_projector = UltravoxProjector(config)
        self.language_model = transformers.LlamaForCausalLM(config.text_config)

    def get_input_embeddings(self):
        return self.language_model.get_input_embeddings()

    def _audio_iter(self, audio_batch_size):
        audio_index = 0
        for i_b, batch_count in enumerate(audio_batch_size):
            for _ in range(batch_count):
                yield i_b, audio_index
                audio_index += 1

    def forward(self, input_ids, audio_values=None, inputs_embeds=None, labels=None,
                attention_mask=None, audio_token_start_idx=None, audio_lens=None,
                audio_token_len=None, audio_batch_size=None, past_key_values=None, **kwargs):
        if inputs_embeds is None:
            inputs_embeds = self.get_input_embeddings().forward(input_ids)
        if audio_values is not None and len(audio_values) > 0:
            inputs_embeds = self._prepare_audio_embeds(
                inputs_embeds=inputs_embeds, audio_values=audio_values,
                audio_token_start_idx=audio_token_start_idx, audio_lens=audio_lens,
                audio_token_len=audio_token_len, audio_batch_size=audio_batch_size)
        return self.language_model.forward(inputs_embeds=inputs_embeds, labels=labels,
                                           attention_mask=attention_mask,
                                           past_key_values=past_key_values, **kwargs)

    def _prepare_audio_embeds(self, inputs_embeds, audio_values, audio_token_start_idx, audio_lens,
                              audio_token_len, audio_batch_size):
        assert len(audio_token_start_idx) == len(audio_token_len) == len(audio_lens) == len(audio_values)
        assert len(audio_batch_size) == len(inputs_embeds)
        audio_tower_output = self.audio_tower.forward(audio_values.to(DTYPE), audio_len=audio_lens).last_hidden_state
        audio_tower_output = audio_tower_output.to(inputs_embeds.dtype)
        audio_embeds = self.multi_modal_projector.forward(audio_tower_output)
        for i_b, i_a in self._audio_iter(audio_batch_size):
            start_idx = audio_token_start_idx[i_a]
            token_len = audio_token_len[i_a]
            item_embedding = audio_embeds[i_a][:token_len]
            inputs_embeds[i_b][start_idx: start_idx + token_len] = item_embedding
        return inputs_embeds

    def generate(self, input_ids, audio_values=None, inputs_embeds=None, audio_token_start_idx=None,
                 audio_lens=None, audio_token_len=None, audio_batch_size=None, **kwargs):
        if inputs_embeds is None:
            inputs_embeds = self.get_input_embeddings().forward(input_ids)
        if audio_values is not None and len(audio_values) > 0:
            inputs_embeds = self._prepare_audio_embeds(
                inputs_embeds=inputs_embeds, audio_values=audio_values,
                audio_token_start_idx=audio_token_start_idx, audio_lens=audio_lens,
                audio_token_len=audio_token_len, audio_batch_size=audio_batch_size)
        return self.language_model.generate(input_ids=input_ids, inputs_embeds=inputs_embeds, **kwargs)


# --------------------------------------------------------------------------- ultravox_processing.py
class UltravoxProcessor:
    def __init__(self, audio_processor, tokenizer, encoder_ds_factor=2, stack_factor=8,
                 audio_placeholder="<|audio|>", audio_context_size=3000):
        self.audio_processor = audio_processor
        self.tokenizer = tokenizer
        self.encoder_ds_factor = encoder_ds_factor
        self.stack_factor = stack_factor
        self.audio_placeholder = audio_placeholder
        self.audio_context_size = audio_context_size
        self.vocab = tokenizer.get_vocab()
        self.audio_token_replacement = tokenizer.eos_token

    def _chunk_and_pad_audio(self, audio_values, audio_lens):
        chunked_audio_values, chunked_audio_lens, is_continuation_list = [], [], []
        context_size = self.audio_context_size or audio_values.shape[-1]
        for i in range(audio_values.shape[0]):
            for offset in range(0, audio_lens[i], context_size):
                is_continuation = offset > 0
                chunk = audio_values[i, :, offset: offset + context_size]
                if is_continuation and chunk.shape[-1] < context_size:
                    chunk = F.pad(chunk, (0, context_size - chunk.shape[-1]))
                chunked_audio_values.append(chunk)
                chunked_audio_lens.append(min(int(audio_lens[i].item()) - offset, context_size))
                is_continuation_list.append(is_continuation)
        return {
            "audio_values": torch.stack(chunked_audio_values, dim=0),
            "audio_lens": torch.tensor(chunked_audio_lens, dtype=torch.int64),
            "audio_is_continuation": torch.tensor(is_continuation_list, dtype=torch.bool),
            "audio_batch_size": torch.tensor([len(chunked_audio_values)]),
        }

    def __call__(self, text=None, audio=None, sampling_rate=None):
        audios = [audio] if audio is not None else []
        data = {}
        audio_is_continuation = []
        if len(audios) > 0:
            audios = [x.numpy() if isinstance(x, torch.Tensor) else x for x in audios]
            hop_length = self.audio_processor.hop_length
            audios = [np.pad(x, (0, 2 * hop_length - len(x)), mode="constant") if len(x) < 2 * hop_length else x
                      for x in audios]
            x = self.audio_processor(audios, sampling_rate=sampling_rate, padding="longest",
                                     pad_to_multiple_of=hop_length, truncation=False, return_attention_mask=True)
            data.update(self._chunk_and_pad_audio(
                audio_values=torch.as_tensor(x.input_features),
                audio_lens=torch.as_tensor(x.attention_mask).sum(-1)))
            audio_is_continuation = data.pop("audio_is_continuation")
            data["audio_token_len"] = torch.ceil(
                data["audio_lens"] / (self.encoder_ds_factor * self.stack_factor)).to(dtype=torch.int)

        if text is not None:
            tokenized_parts = self.tokenizer(text.split("<|audio|>"), add_special_tokens=False)
            audio_token_start_idx = []
            placeholder_index = -1
            split_input_ids = tokenized_parts["input_ids"]
            input_ids = []
            audio_replacement_token_id = self.vocab[self.audio_token_replacement]
            for i, token_len in enumerate(data.get("audio_token_len", [])):
                if not audio_is_continuation[i]:
                    placeholder_index += 1
                    input_ids.extend(split_input_ids[placeholder_index])
                audio_token_start_idx.append(len(input_ids))
                input_ids.extend([audio_replacement_token_id] * token_len)
            placeholder_index += 1
            assert placeholder_index == len(split_input_ids) - 1
            input_ids.extend(split_input_ids[placeholder_index])
            if "audio_token_len" in data:
                data["audio_token_start_idx"] = torch.as_tensor(audio_token_start_idx)
            data["input_ids"] = torch.tensor([input_ids])
            data["attention_mask"] = torch.tensor([[1] * len(input_ids)])
        return data


class DataCollatorForSeq2SeqWithAudio(transformers.DataCollatorForSeq2Seq):
    def __call__(self, features, *args, **kwargs):
        audio_values = [x for f in features for x in f.pop("audio_values", [])]
        audio_lens = [x for f in features for x in f.pop("audio_lens", [])]
        audio_token_len = [x for f in features for x in f.pop("audio_token_len", [])]
        audio_token_start_idx = [x for f in features for x in f.pop("audio_token_start_idx", [])]

        batch = super().__call__(features, *args, **kwargs)

        if audio_values and len(audio_values) > 0 and len(audio_values[0]) > 0:
            batch["audio_token_start_idx"] = torch.stack(audio_token_start_idx)
            batch["audio_lens"] = torch.stack(audio_lens)
            batch["audio_token_len"] = torch.stack(audio_token_len)
            # Pad the last dimension of all audio_values to the same length, with 0s on the right.
            max_len = max([x.shape[-1] for x in audio_values])
            batch["audio_values"] = torch.stack([F.pad(x, (0, max_len - x.shape[-1])) for x in audio_values])
            if self.tokenizer.padding_side == "left":
                input_ids_lens = torch.LongTensor([f["input_ids"].shape[-1] for f in features])
                displacement = batch["input_ids"].shape[-1] - input_ids_lens
                displacement = displacement.repeat_interleave(batch["audio_batch_size"].squeeze(-1))
                batch["audio_token_start_idx"] += displacement.to(batch["audio_token_start_idx"].device)
        return batch


# --------------------------------------------------------------------------- ultravox_data_proc.py
def dataproc_train(processor, messages, audio):
    text = processor.tokenizer.apply_chat_template(messages, tokenize=False)
    inputs = processor(text=text, audio=audio, sampling_rate=16000)
    input_ids = inputs["input_ids"].squeeze_(0)
    inputs["attention_mask"].squeeze_(0)
    labels = input_ids.clone()
    # LossMaskType.LAST_ASSISTANT
    user_text = processor.tokenizer.apply_chat_template(messages[:-1], tokenize=False)
    loss_mask_len = processor(text=user_text, audio=audio, sampling_rate=16000)["input_ids"].shape[-1]
    labels[:loss_mask_len] = -100
    return {**inputs, "labels": labels.tolist()}


def dataproc_infer(processor, messages, audio):  # LocalInference._dataproc + the squeeze in infer_batch
    text_input = processor.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    inputs = processor(text=text_input, audio=torch.from_numpy(audio), sampling_rate=16000)
    inputs["audio_values"] = inputs["audio_values"].to(dtype=DTYPE)
    for key, val in inputs.items():
        if not key.startswith("audio"):
            inputs[key] = val.squeeze(0)
    return inputs


# --------------------------------------------------------------------------- build
N_MELS, STACK = 16, 8
audio_config = transformers.WhisperConfig(
    num_mel_bins=N_MELS, d_model=32, encoder_layers=2, encoder_attention_heads=4, encoder_ffn_dim=64,
    decoder_layers=1, decoder_attention_heads=4, decoder_ffn_dim=64, max_source_positions=64,
    dropout=0.0, attention_dropout=0.0, activation_dropout=0.0, encoder_layerdrop=0.0)
text_config = transformers.LlamaConfig(
    vocab_size=len(words), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
    bos_token_id=tok.bos_token_id, eos_token_id=EOS, pad_token_id=EOS)
config = UltravoxConfig(audio_config=audio_config, text_config=text_config, hidden_size=64, stack_factor=STACK)
model = UltravoxModel(config).to(DTYPE).eval()

feature_extractor = transformers.WhisperFeatureExtractor(feature_size=N_MELS, sampling_rate=16000,
                                                         hop_length=160, chunk_length=30, n_fft=400)
processor = UltravoxProcessor(feature_extractor, tok, stack_factor=STACK,
                              audio_context_size=model.audio_tower.max_context_length)

# utterances of 32, 112, 48 and 80 mel frames (whole stacks of encoder frames)
audios = [(0.1 * np.random.randn(160 * n)).astype(np.float32) for n in (32, 112, 48, 80)]
convs = [
    [{"role": "user", "content": "transcribe the audio <|audio|>"}, {"role": "assistant", "content": "hello world"}],
    [{"role": "user", "content": "<|audio|> what did the speaker say"},
     {"role": "assistant", "content": "good morning how are you today"}],
    [{"role": "user", "content": "please transcribe <|audio|> please"}, {"role": "assistant", "content": "yes"}],
    [{"role": "user", "content": "<|audio|>"}, {"role": "assistant", "content": "no it is raining today"}],
]

worst = 0.0

# ---- training step: right padding
tok.padding_side = "right"
collator = DataCollatorForSeq2SeqWithAudio(tokenizer=tok)
feats = [dataproc_train(processor, m, a) for m, a in zip(convs, audios)]
singles = [{k: (v.clone() if torch.is_tensor(v) else list(v)) for k, v in f.items()} for f in feats]
batch = collator(feats)
assert (batch["attention_mask"] == 0).any()
batch["audio_values"] = batch["audio_values"].to(DTYPE)
with torch.no_grad():
    out = model(**batch)
    total, count = 0.0, 0
    for b, s in enumerate(singles):
        n = s["input_ids"].shape[-1]
        ids = s["input_ids"][None]
        ref = model(ids, audio_values=s["audio_values"].to(DTYPE), audio_token_start_idx=s["audio_token_start_idx"],
                    audio_lens=s["audio_lens"], audio_token_len=s["audio_token_len"],
                    audio_batch_size=s["audio_batch_size"][None], attention_mask=None).logits[0]
        worst = max(worst, (out.logits[b, :n] - ref).abs().max().item())
        labels = s["labels"]
        for t in range(n - 1):
            if labels[t + 1] != -100:
                total += -torch.log_softmax(ref[t], -1)[labels[t + 1]].item()
                count += 1
    loss_diff = abs(out.loss.item() - total / count)
    assert loss_diff < 1e-6 * total / count, loss_diff  # transformers' ForCausalLMLoss upcasts the logits to float32

    # the audio tower alone: real encoder frames of the padded batch vs each utterance's own frames
    enc = model.audio_tower(batch["audio_values"], audio_len=batch["audio_lens"]).last_hidden_state
    for b, s in enumerate(singles):
        own = model.audio_tower(s["audio_values"].to(DTYPE)).last_hidden_state[0]
        worst = max(worst, (enc[b, :own.shape[0]] - own).abs().max().item())

# ---- batched inference: left padding, greedy generate with the LLM's KV cache
tok.padding_side = "left"
collator = DataCollatorForSeq2SeqWithAudio(tokenizer=tok)
prompts = [m[:1] for m in convs]
inputs = [dataproc_infer(processor, m, a) for m, a in zip(prompts, audios)]
singles = [{k: v.clone() for k, v in i.items()} for i in inputs]
tensors = collator(inputs)
assert (tensors["attention_mask"][:, 0] == 0).any()
input_len = tensors["input_ids"].shape[1]
gen_kwargs = dict(max_new_tokens=6, do_sample=False, top_p=None, top_k=None, pad_token_id=EOS,
                  eos_token_id=[EOS], output_scores=True, return_dict_in_generate=True)
with torch.no_grad():
    res = model.generate(**tensors, **gen_kwargs)
    for b, s in enumerate(singles):
        ref = model.generate(s["input_ids"][None], audio_values=s["audio_values"],
                             audio_token_start_idx=s["audio_token_start_idx"], audio_lens=s["audio_lens"],
                             audio_token_len=s["audio_token_len"], audio_batch_size=s["audio_batch_size"][None],
                             attention_mask=s["attention_mask"][None], **gen_kwargs)
        ref_new = ref.sequences[0, s["input_ids"].shape[-1]:]
        got_new = res.sequences[b, input_len:]
        assert torch.equal(got_new[:len(ref_new)], ref_new), (b, got_new, ref_new)
        assert (got_new[len(ref_new):] == EOS).all()
        for step in range(len(ref_new)):
            worst = max(worst, (res.scores[step][b] - ref.scores[step][0]).abs().max().item())

print(f"max |batched - per-utterance| (logits, encoder frames, generate scores) = {worst:.2e}")
assert worst < 1e-10, worst
print("ok")
