"""IndexTTS batched GPT inference: the text attention mask got its start/stop ones at the padded row's ends.

Citation: index-tts/index-tts commit 3ce7ccb ("优化文本掩码填充逻辑，改进句子桶化处理", fixing the mask added
in d80d49e "优化inference attention mask"), indextts/gpt/model.py ``UnifiedVoice.inference_speech``.

``IndexTTS.infer_fast`` buckets sentences and right-pads each bucket's text tokens with
``stop_text_token`` (``pad_tokens_cat``, model version >= 1.5). ``inference_speech`` then appends a
stop token, prepends a start token, and builds the text part of the generation mask from
``(text != stop) & (text != start)``. Before the fix it widened that mask with
``F.pad(text_masks, (1, 1), value=1)``: the ones meant for the start and stop tokens land at column 0
and at the last column of the padded row. For a shorter sentence the real stop token (right after
its last text token) is masked out and the trailing stop token after the padding is attended,
carrying text position embedding L+1 instead of n+1.

The fix, ``UnifiedVoice.pad_text_masks``, sets ones from one column before the first real token to
one column after the last one (``[1, 1, 1, 1, 0] -> [1, 1, 1, 1, 1, 1, 0]``).

Ported at toy sizes (GPT-2 with 2 layers, 32-dim, 2 heads, built from GPT2Config, null built-in
position embeddings, learned text / mel position embeddings, GPT2InferenceModel with its cached
conditioning+text embeddings and kv cache). The conformer + perceiver conditioning encoder is
replaced by a small stand-in that turns the reference mel into ``cond_num`` latents (all rows share
one reference, as in ``infer_fast``). Embedding and GPT-2 weights are re-drawn at a larger scale
so that the text changes the generated codes. For the installed transformers, ``GenerationMixin``
is added to GPT2InferenceModel and its ``if past_key_values:`` test reads the cache's length;
greedy decoding instead of sampling.
"""

import functools
import sys
import warnings
from typing import List

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.utils.rnn import pad_sequence
import transformers
from transformers import GenerationMixin, GPT2Config, GPT2Model, GPT2PreTrainedModel
from transformers.modeling_outputs import CausalLMOutputWithCrossAttentions

FIXED = "--fixed" in sys.argv


def null_position_embeddings(range, dim):
    return torch.zeros((range.shape[0], range.shape[1], dim), device=range.device)


class GPT2InferenceModel(GPT2PreTrainedModel, GenerationMixin):
    def __init__(self, config, gpt, text_pos_emb, embeddings, norm, linear, kv_cache=False):
        super().__init__(config)
        self.transformer = gpt
        self.text_pos_embedding = text_pos_emb
        self.embeddings = embeddings
        self.final_norm = norm
        self.lm_head = nn.Sequential(norm, linear)
        self.kv_cache = kv_cache
        self.cached_mel_emb = None

    def get_output_embeddings(self):
        return self.lm_head

    def store_mel_emb(self, mel_emb):
        self.cached_mel_emb = mel_emb

    def prepare_inputs_for_generation(self, input_ids, past_key_values=None, **kwargs):
        token_type_ids = kwargs.get("token_type_ids", None)  # usually None
        if not self.kv_cache:
            past_key_values = None
        # only last token for inputs_ids if past is defined in kwargs
        if past_key_values is not None and past_key_values.get_seq_length() > 0:
            input_ids = input_ids[:, -1].unsqueeze(-1)
            if token_type_ids is not None:
                token_type_ids = token_type_ids[:, -1].unsqueeze(-1)

        attention_mask = kwargs.get("attention_mask", None)
        position_ids = kwargs.get("position_ids", None)

        if attention_mask is not None and position_ids is None:
            # create position_ids on the fly for batch generation
            position_ids = attention_mask.long().cumsum(-1) - 1
            position_ids.masked_fill_(attention_mask == 0, 1)
            if past_key_values is not None and past_key_values.get_seq_length() > 0:
                position_ids = position_ids[:, -1].unsqueeze(-1)
        else:
            position_ids = None
        return {
            "input_ids": input_ids,
            "past_key_values": past_key_values,
            "use_cache": kwargs.get("use_cache"),
            "position_ids": position_ids,
            "attention_mask": attention_mask,
            "token_type_ids": token_type_ids,
        }

    def forward(
        self,
        input_ids=None,
        past_key_values=None,
        attention_mask=None,
        token_type_ids=None,
        position_ids=None,
        use_cache=None,
        return_dict=None,
        **kwargs,
    ):
        assert self.cached_mel_emb is not None
        # Create embedding
        mel_len = self.cached_mel_emb.shape[1]
        if input_ids.shape[1] != 1:
            text_inputs = input_ids[:, mel_len:]
            text_emb = self.embeddings(text_inputs)
            text_emb = text_emb + self.text_pos_embedding(text_emb)
            if self.cached_mel_emb.shape[0] != text_emb.shape[0]:
                mel_emb = self.cached_mel_emb.repeat_interleave(
                    text_emb.shape[0] // self.cached_mel_emb.shape[0], 0
                )
            else:  # this outcome only occurs once per loop in most cases
                mel_emb = self.cached_mel_emb
            emb = torch.cat([mel_emb, text_emb], dim=1)
        else:
            emb = self.embeddings(input_ids)
            emb = emb + self.text_pos_embedding.get_fixed_embedding(
                attention_mask.shape[1] - mel_len, attention_mask.device
            )
        transformer_outputs = self.transformer(
            inputs_embeds=emb,
            past_key_values=past_key_values,
            attention_mask=attention_mask,
            token_type_ids=token_type_ids,
            position_ids=position_ids,
            use_cache=use_cache,
            return_dict=True,
        )
        hidden_states = transformer_outputs[0]
        lm_logits = self.lm_head(hidden_states)
        return CausalLMOutputWithCrossAttentions(
            loss=None,
            logits=lm_logits,
            past_key_values=transformer_outputs.past_key_values,
            hidden_states=transformer_outputs.hidden_states,
            attentions=transformer_outputs.attentions,
        )


class LearnedPositionEmbeddings(nn.Module):
    def __init__(self, seq_len, model_dim, init=.02):
        super().__init__()
        self.emb = nn.Embedding(seq_len, model_dim)
        # Initializing this way is standard for GPT-2
        self.emb.weight.data.normal_(mean=0.0, std=init)

    def forward(self, x):
        sl = x.shape[1]
        return self.emb(torch.arange(0, sl, device=x.device))

    def get_fixed_embedding(self, ind, dev):
        return self.emb(torch.tensor([ind], device=dev)).unsqueeze(0)


def build_hf_gpt_transformer(layers, model_dim, heads, max_mel_seq_len, max_text_seq_len, checkpointing, activation_function):
    """
    GPT-2 implemented by the HuggingFace library.
    """
    gpt_config = GPT2Config(vocab_size=256,  # Unused.
                            n_positions=max_mel_seq_len + max_text_seq_len,
                            n_ctx=max_mel_seq_len + max_text_seq_len,
                            n_embd=model_dim,
                            n_layer=layers,
                            n_head=heads,
                            activation_function=activation_function or "gelu_new",
                            gradient_checkpointing=checkpointing,
                            use_cache=not checkpointing)
    gpt = GPT2Model(gpt_config)
    # Override the built in positional embeddings
    del gpt.wpe
    gpt.wpe = functools.partial(null_position_embeddings, dim=model_dim)
    # Built-in token embeddings are unused.
    del gpt.wte
    return gpt, LearnedPositionEmbeddings(max_mel_seq_len, model_dim), LearnedPositionEmbeddings(max_text_seq_len, model_dim), \
        None, None


class UnifiedVoice(nn.Module):
    def __init__(self, layers=2, model_dim=32, heads=2, max_text_tokens=24, max_mel_tokens=32, max_conditioning_inputs=1,
                 number_text_tokens=40, start_text_token=0, stop_text_token=1, number_mel_codes=50,
                 start_mel_token=48, stop_mel_token=49, checkpointing=False, condition_num_latent=4):
        super().__init__()
        self.number_text_tokens = number_text_tokens
        self.start_text_token = start_text_token
        self.stop_text_token = stop_text_token
        self.number_mel_codes = number_mel_codes
        self.start_mel_token = start_mel_token
        self.stop_mel_token = stop_mel_token
        self.layers = layers
        self.heads = heads
        self.max_mel_tokens = max_mel_tokens
        self.max_text_tokens = max_text_tokens
        self.model_dim = model_dim
        self.max_conditioning_inputs = max_conditioning_inputs
        self.cond_num = condition_num_latent
        # stand-in for ConformerEncoder + PerceiverResampler: (b, 100, s) mel -> (b, cond_num, d)
        self.conditioning_encoder = nn.Conv1d(100, model_dim, kernel_size=1)

        self.text_embedding = nn.Embedding(self.number_text_tokens + 1, model_dim)
        self.mel_embedding = nn.Embedding(self.number_mel_codes, model_dim)
        self.gpt, self.mel_pos_embedding, self.text_pos_embedding, self.mel_layer_pos_embedding, self.text_layer_pos_embedding = \
            build_hf_gpt_transformer(layers, model_dim, heads, self.max_mel_tokens + 2 + self.max_conditioning_inputs,
                                     self.max_text_tokens + 2, checkpointing, None)
        self.final_norm = nn.LayerNorm(model_dim)
        self.text_head = nn.Linear(model_dim, self.number_text_tokens + 1)
        self.mel_head = nn.Linear(model_dim, self.number_mel_codes)
        for module in [self.text_embedding, self.mel_embedding]:
            module.weight.data.normal_(mean=0.0, std=.02)

    def post_init_gpt2_config(self, kv_cache=False):
        seq_length = self.max_mel_tokens + self.max_text_tokens + 2
        gpt_config = GPT2Config(
            vocab_size=self.max_mel_tokens,
            n_positions=seq_length,
            n_ctx=seq_length,
            n_embd=self.model_dim,
            n_layer=self.layers,
            n_head=self.heads,
            gradient_checkpointing=False,
            use_cache=True,
        )
        self.inference_model = GPT2InferenceModel(
            gpt_config,
            self.gpt,
            self.mel_pos_embedding,
            self.mel_embedding,
            self.final_norm,
            self.mel_head,
            kv_cache=kv_cache,
        )
        self.inference_model = self.inference_model.eval()
        self.gpt.wte = self.mel_embedding

    def build_aligned_inputs_and_targets(self, input, start_token, stop_token):
        inp = F.pad(input, (1, 0), value=start_token)
        tar = F.pad(input, (0, 1), value=stop_token)
        return inp, tar

    def get_conditioning(self, speech_conditioning_input, cond_mel_lengths=None):
        h = self.conditioning_encoder(speech_conditioning_input)  # (b, d, s)
        conds = F.adaptive_avg_pool1d(h, self.cond_num).transpose(1, 2)  # (b, cond_num, d)
        return conds

    @staticmethod
    def pad_text_masks(text_masks):
        """
        pad masks to [b, t+2]. e.g.:
        ```
        [
            [1, 1, 1, 1, 1] -> [1, 1, 1, 1, 1, 1, 1]
            [1, 1, 1, 1, 0] -> [1, 1, 1, 1, 1, 1, 0]
            [0, 0, 0, 0, 0] -> [0, 0, 0, 0, 0, 1, 1]
            [1, 0, 0, 0, 0] -> [1, 1, 1, 0, 0, 0, 0]
            [0, 0, 1, 1, 1] -> [0, 0, 1, 1, 1, 1, 1]
        ]
        ```
        text_masks: [b, t]
        padded_masks: [b, t+2]
        """
        b, t = text_masks.size()
        padded = torch.nn.functional.pad(text_masks, (1, 1), value=0)  # [b, t+2]
        padded = torch.ones_like(padded, dtype=text_masks.dtype, device=text_masks.device)

        # Find the first and last non-zero index
        # and set the values before the first index and after the last index to 0
        nonzero_mask = text_masks != 0
        has_nonzero = nonzero_mask.any(dim=1)
        first_idx = nonzero_mask.float().argmax(dim=1)
        rev_mask = nonzero_mask.flip(dims=[1])
        last_idx = t - rev_mask.float().argmax(dim=1)
        first_idx = first_idx.reshape(b, 1)
        last_idx = last_idx.reshape(b, 1)
        col_idx = torch.arange(t+2, device=text_masks.device).unsqueeze(0).expand(b, -1)  # [b, t_2]
        padded[col_idx < first_idx] = 0
        padded[col_idx > last_idx+1] = 0
        # all zeros
        padded[~has_nonzero, :-2] = 0
        return padded

    def inference_speech(self, speech_conditioning_latent, text_inputs, cond_mel_lengths=None, input_tokens=None, num_return_sequences=1,
                         max_generate_length=None, **hf_generate_kwargs):

        text_masks = ((text_inputs != self.stop_text_token) & (text_inputs != self.start_text_token)).long()
        text_inputs = F.pad(text_inputs, (0, 1), value=self.stop_text_token)
        text_inputs, _ = self.build_aligned_inputs_and_targets(text_inputs, self.start_text_token, self.stop_text_token)
        if FIXED:
            text_masks = UnifiedVoice.pad_text_masks(text_masks) # [b, t+2]
        else:
            text_masks = F.pad(text_masks, (1, 1), value=1) # (-1, +1)
        text_emb = self.text_embedding(text_inputs) + self.text_pos_embedding(text_inputs)
        speech_conditioning_latent = self.get_conditioning(speech_conditioning_latent, cond_mel_lengths)
        conds = speech_conditioning_latent
        emb = torch.cat([conds, text_emb], dim=1)
        self.inference_model.store_mel_emb(emb)

        # +1 for the start_audio_token
        fake_inputs = torch.full((emb.shape[0], emb.shape[1] + 1,), fill_value=1, dtype=torch.long,
                                 device=text_inputs.device)
        attention_mask = torch.cat([
            torch.ones((conds.shape[0], conds.shape[1]), dtype=torch.long, device=text_inputs.device),
            text_masks,
            torch.ones((conds.shape[0], 1), dtype=torch.long, device=text_inputs.device),
        ], dim=1)
        fake_inputs[:, -1] = self.start_mel_token
        trunc_index = fake_inputs.shape[1]
        inputs = fake_inputs

        max_length = trunc_index + self.max_mel_tokens - 1 if max_generate_length is None else trunc_index + max_generate_length
        gen = self.inference_model.generate(inputs, bos_token_id=self.start_mel_token, pad_token_id=self.stop_mel_token,
                                            eos_token_id=self.stop_mel_token, attention_mask=attention_mask,
                                            max_length=max_length,
                                            num_return_sequences=num_return_sequences, **hf_generate_kwargs)
        return gen[:, trunc_index:]


# ---- indextts/infer.py: IndexTTS.pad_tokens_cat (model_version >= 1.5) ---------------------------
def pad_tokens_cat(tokens: List[torch.Tensor], stop_text_token: int) -> torch.Tensor:
    # 1.5版本以上，直接使用stop_text_token 右侧填充
    # [1, N] -> [N,]
    tokens = [t.squeeze(0) for t in tokens]
    return pad_sequence(tokens, batch_first=True, padding_value=stop_text_token, padding_side="right")


def main():
    warnings.filterwarnings("ignore")
    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    gpt = UnifiedVoice().eval()
    # stand-in for trained weights: embeddings on the scale of the hidden states
    for emb in (gpt.text_embedding, gpt.mel_embedding, gpt.text_pos_embedding.emb, gpt.mel_pos_embedding.emb):
        emb.weight.data.normal_(mean=0.0, std=1.0)
    for name, param in gpt.gpt.named_parameters():
        if name.endswith("c_attn.weight") or name.endswith("c_fc.weight") or name.endswith("c_proj.weight"):
            param.data.normal_(mean=0.0, std=0.3)
    gpt.post_init_gpt2_config(kv_cache=True)

    # one bucket of two sentences (already tokenized), one reference voice for all of them
    item_tokens = [
        torch.tensor([[5, 9, 13, 21, 7, 30, 11, 18]], dtype=torch.int32),
        torch.tensor([[22, 6, 17, 3]], dtype=torch.int32),
    ]
    batch_text_tokens = pad_tokens_cat(item_tokens, gpt.stop_text_token)
    auto_conditioning = torch.randn(1, 100, 40)
    cond_mel_lengths = torch.tensor([auto_conditioning.shape[-1]])
    batch_num = len(item_tokens)
    batch_auto_conditioning = auto_conditioning.expand(batch_num, -1, -1)
    batch_cond_mel_lengths = cond_mel_lengths.expand(batch_num)

    with torch.no_grad():
        codes = gpt.inference_speech(batch_auto_conditioning, batch_text_tokens,
                                     cond_mel_lengths=batch_cond_mel_lengths,
                                     do_sample=False, num_beams=1, max_generate_length=12)
    for i, row in enumerate(codes.tolist()):
        print(f"sentence {i}: mel codes {row}")


if __name__ == "__main__":
    main()
