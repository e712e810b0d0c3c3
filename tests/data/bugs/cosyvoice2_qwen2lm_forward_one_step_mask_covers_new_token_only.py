# Citation: filliptm/ComfyUI_FL-CosyVoice3#7 ("Question: Source of llm.py attention mask fix?"); the fix is in
# filliptm/ComfyUI_FL-CosyVoice3 cosyvoice/llm/llm.py (commit c92154ec4b4db0c7ab6c7c53184a32ec7bb71208),
# Qwen2Encoder.forward_one_step, against FunAudioLLM/CosyVoice cosyvoice/llm/llm.py @ace7c47 (Qwen2Encoder,
# Qwen2LM.inference / inference_wrapper).
#
# Bug: CosyVoice 2's speech-token LM decodes one token at a time with a KV cache.  inference_wrapper builds
# `masks = tril(ones(1, L, L))` over the *current* input only (the whole prompt at step 0, then the one new
# speech token), and forward_one_step hands `masks[:, -1, :]` to Qwen2ForCausalLM as its 2-D attention_mask.
# From the second step on that mask has length 1 while the cache holds the prompt and every earlier token; newer
# transformers read the missing columns as padding, so each new speech token sees only the first cached
# position (sos) and none of the text, the prompt speech tokens or itself ("gibberish audio" in the issue).
# Fix: on cached steps, pass an all-ones mask of length cached_len + new tokens.
import sys

import torch
import torch.nn as nn
from transformers import Qwen2Config, Qwen2ForCausalLM

FIXED = "--fixed" in sys.argv


def make_pad_mask(lengths: torch.Tensor, max_len: int = 0) -> torch.Tensor:
    batch_size = lengths.size(0)
    max_len = max_len if max_len > 0 else lengths.max().item()
    seq_range = torch.arange(0, max_len, dtype=torch.int64, device=lengths.device)
    seq_range_expand = seq_range.unsqueeze(0).expand(batch_size, max_len)
    seq_length_expand = lengths.unsqueeze(-1)
    mask = seq_range_expand >= seq_length_expand
    return mask


class Qwen2Encoder(torch.nn.Module):
    def __init__(self, config):
        super().__init__()
        # upstream: Qwen2ForCausalLM.from_pretrained(pretrain_path); a tiny random one here
        self.model = Qwen2ForCausalLM(config)

    def forward(self, xs: torch.Tensor, xs_lens: torch.Tensor):
        T = xs.size(1)
        masks = ~make_pad_mask(xs_lens, T)
        outs = self.model(
            inputs_embeds=xs,
            attention_mask=masks,
            output_hidden_states=True,
            return_dict=True,
        )
        return outs.hidden_states[-1], masks.unsqueeze(1)

    def forward_one_step(self, xs, masks, cache=None):
        if FIXED and cache is not None:
            # For cached inference, the attention mask must cover the full sequence (cached + new positions)
            if hasattr(cache, 'get_seq_length'):
                cached_len = cache.get_seq_length()
            elif hasattr(cache, '__len__') and len(cache) > 0:
                cached_len = cache[0][0].shape[2]
            else:
                cached_len = 0
            total_len = cached_len + xs.shape[1]
            input_masks = torch.ones((xs.shape[0], total_len), dtype=torch.long, device=xs.device)
        else:
            input_masks = masks[:, -1, :]
        outs = self.model(
            inputs_embeds=xs,
            attention_mask=input_masks,
            output_hidden_states=True,
            return_dict=True,
            use_cache=True,
            past_key_values=cache,
        )
        xs = outs.hidden_states[-1]
        new_cache = outs.past_key_values
        return xs, new_cache


def topk_sampling(weighted_scores, decoded_tokens, top_k=25, generator=None):
    # stands in for cosyvoice.utils.common.ras_sampling / random_sampling (seeded so both runs draw alike)
    prob, indices = weighted_scores.softmax(dim=0).topk(top_k)
    top_ids = indices[prob.multinomial(1, replacement=True, generator=generator)]
    return top_ids.item()


class Qwen2LM(nn.Module):
    def __init__(self, llm_input_size, llm_output_size, speech_token_size, llm, sampling):
        super().__init__()
        self.llm_input_size = llm_input_size
        self.llm_output_size = llm_output_size
        self.speech_token_size = speech_token_size
        self.sos = 0
        self.task_id = 1
        self.eos_token = speech_token_size
        self.fill_token = speech_token_size + 2

        self.llm_embedding = torch.nn.Embedding(2, llm_input_size)
        self.llm = llm
        self.llm_decoder = nn.Linear(llm_output_size, speech_token_size + 3)
        self.speech_embedding = torch.nn.Embedding(speech_token_size + 3, llm_input_size)
        self.sampling = sampling
        self.stop_token_ids = [speech_token_size + i for i in range(3)]

    def sampling_ids(self, weighted_scores, decoded_tokens, sampling, ignore_eos=True):
        num_trials, max_trials = 0, 100
        while True:
            top_ids = self.sampling(weighted_scores, decoded_tokens, sampling)
            if (not ignore_eos) or (top_ids < self.speech_token_size):
                break
            num_trials += 1
            if num_trials > max_trials:
                raise RuntimeError('sampling reaches max_trials {} and still get eos when ignore_eos is True, check your input!'.format(max_trials))
        return top_ids

    @torch.inference_mode()
    def inference(self, text, text_len, prompt_text, prompt_text_len, prompt_speech_token, prompt_speech_token_len,
                  sampling=25, max_token_text_ratio=20, min_token_text_ratio=2):
        device = text.device
        text = torch.concat([prompt_text, text], dim=1)
        text_len += prompt_text_len
        text_emb = self.llm.model.model.embed_tokens(text)

        sos_emb = self.llm_embedding.weight[self.sos].reshape(1, 1, -1)
        task_id_emb = self.llm_embedding.weight[self.task_id].reshape(1, 1, -1)
        if prompt_speech_token_len != 0:
            prompt_speech_token_emb = self.speech_embedding(prompt_speech_token)
        else:
            prompt_speech_token_emb = torch.zeros(1, 0, self.llm_input_size, dtype=text_emb.dtype).to(device)
        lm_input = torch.concat([sos_emb, text_emb, task_id_emb, prompt_speech_token_emb], dim=1)

        min_len = int((text_len - prompt_text_len) * min_token_text_ratio)
        max_len = int((text_len - prompt_text_len) * max_token_text_ratio)

        for token in self.inference_wrapper(lm_input, sampling, min_len, max_len):
            yield token

    @torch.inference_mode()
    def inference_wrapper(self, lm_input, sampling, min_len, max_len):
        out_tokens = []
        cache = None
        for i in range(max_len):
            y_pred, cache = self.llm.forward_one_step(lm_input,
                                                      masks=torch.tril(torch.ones((1, lm_input.shape[1], lm_input.shape[1]), device=lm_input.device)).to(torch.bool),
                                                      cache=cache)
            logp = self.llm_decoder(y_pred[:, -1]).log_softmax(dim=-1)
            top_ids = self.sampling_ids(logp.squeeze(dim=0), out_tokens, sampling, ignore_eos=True if i < min_len else False)
            if top_ids in self.stop_token_ids:
                break
            yield top_ids
            out_tokens.append(top_ids)
            lm_input = self.speech_embedding.weight[top_ids].reshape(1, 1, -1)


def main():
    torch.manual_seed(0)
    config = Qwen2Config(
        vocab_size=200, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
        attn_implementation="sdpa", initializer_range=0.2,
    )
    speech_token_size = 50
    gen = torch.Generator().manual_seed(1234)
    lm = Qwen2LM(64, 64, speech_token_size, Qwen2Encoder(config),
                 sampling=lambda s, d, k: topk_sampling(s, d, top_k=k, generator=gen)).eval()

    prompt_text = torch.randint(3, 200, (1, 5))
    text = torch.randint(3, 200, (1, 4))
    prompt_speech_token = torch.randint(0, speech_token_size, (1, 6))
    tokens = list(lm.inference(text, torch.tensor([4]), prompt_text, torch.tensor([5]),
                               prompt_speech_token, torch.tensor([6]),
                               sampling=5, max_token_text_ratio=5, min_token_text_ratio=3))
    print("speech tokens:", tokens)


if __name__ == "__main__":
    main()
