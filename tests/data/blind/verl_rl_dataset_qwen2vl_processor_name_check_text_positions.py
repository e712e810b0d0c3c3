# verl-project/verl#1947 ("[fsdp] fix: position_ids in qwen-vl", merged).
#
# verl's RLHFDataset.__getitem__ decides whether a prompt gets Qwen2-VL's 3-D mrope position ids
# (get_rope_index: image tokens at (t, h, w) grid positions, text after them resuming from the
# grid's max) or plain 1-D ids (compute_position_id_with_mask, cumsum of the left-padded mask) by
# the image processor's class name:
#     if self.processor is not None and self.processor.image_processor.__class__.__name__ == "Qwen2VLImageProcessor":
# A processor loaded with use_fast=True carries Qwen2VLImageProcessorFast, so the test fails and the
# batch is built with 1-D positions; the actor (dp_actor._forward_micro_batch) hands them to
# Qwen2VLForConditionalGeneration, which broadcasts them to the three mrope sections: the image's
# tokens get sequential positions and every later token is shifted. Fix: test
# `"Qwen2VLImageProcessor" in ...__class__.__name__`.
# Here the processor's image processor is transformers' Qwen2VLImageProcessorPil (the class
# transformers 5 hands out without torchvision; its name differs from "Qwen2VLImageProcessor" the
# same way the Fast one's does). The second part of the PR (ulysses_pad for 3-D ids) is not ported.
import sys

import numpy as np
import torch
import torch.nn.functional as F
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast, Qwen2VLConfig, Qwen2VLForConditionalGeneration
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

FIXED = "--fixed" in sys.argv


# ---- verl/utils/torch_functional.py ----
def pad_sequence_to_length(tensors, max_seq_len, pad_token_id, left_pad=False):
    if tensors.shape[-1] >= max_seq_len:
        return tensors
    pad_tuple = (max_seq_len - tensors.shape[-1], 0) if left_pad else (0, max_seq_len - tensors.shape[-1])
    return F.pad(tensors, pad_tuple, "constant", pad_token_id)


def postprocess_data(input_ids, attention_mask, max_length, pad_token_id, left_pad=True, truncation="error"):
    assert input_ids.ndim == 2
    sequence_length = input_ids.shape[-1]
    if sequence_length < max_length:
        input_ids = pad_sequence_to_length(input_ids, max_seq_len=max_length, pad_token_id=pad_token_id, left_pad=left_pad)
        attention_mask = pad_sequence_to_length(attention_mask, max_seq_len=max_length, pad_token_id=0, left_pad=left_pad)
    elif sequence_length > max_length:
        raise NotImplementedError(f"{sequence_length=} is larger than {max_length=}")
    return input_ids, attention_mask


def logprobs_from_logits(logits, labels):
    logp = F.log_softmax(logits, dim=-1)
    return torch.gather(logp, -1, labels.unsqueeze(-1)).squeeze(-1)


# ---- verl/utils/model.py ----
def compute_position_id_with_mask(mask):
    return torch.clip(torch.cumsum(mask, dim=-1) - 1, min=0, max=None)


# ---- verl/models/transformers/qwen2_vl.py ----
def get_rope_index(processor, input_ids, image_grid_thw=None, video_grid_thw=None, second_per_grid_ts=None, attention_mask=None):
    spatial_merge_size = processor.image_processor.merge_size
    tokens_per_second = 2
    image_token_id = processor.tokenizer.convert_tokens_to_ids("<|image_pad|>")
    video_token_id = processor.tokenizer.convert_tokens_to_ids("<|video_pad|>")
    vision_start_token_id = processor.tokenizer.convert_tokens_to_ids("<|vision_start|>")
    if input_ids is not None and (image_grid_thw is not None or video_grid_thw is not None):
        if attention_mask is None:
            attention_mask = torch.ones_like(input_ids)

        position_ids = torch.ones(3, input_ids.size(0), dtype=input_ids.dtype, device=input_ids.device)  # (3, seqlen)
        image_index, video_index = 0, 0
        input_ids = input_ids[attention_mask == 1]
        image_nums, video_nums = 0, 0
        vision_start_indices = torch.argwhere(input_ids == vision_start_token_id)
        vision_tokens = input_ids[vision_start_indices + 1]
        image_nums = (vision_tokens == image_token_id).sum()
        video_nums = (vision_tokens == video_token_id).sum()
        input_tokens = input_ids.tolist()
        llm_pos_ids_list: list = []
        st = 0
        remain_images, remain_videos = image_nums, video_nums
        for _ in range(image_nums + video_nums):
            if image_token_id in input_tokens and remain_images > 0:
                ed_image = input_tokens.index(image_token_id, st)
            else:
                ed_image = len(input_tokens) + 1
            if video_token_id in input_tokens and remain_videos > 0:
                ed_video = input_tokens.index(video_token_id, st)
            else:
                ed_video = len(input_tokens) + 1
            if ed_image < ed_video:
                t, h, w = image_grid_thw[image_index][0], image_grid_thw[image_index][1], image_grid_thw[image_index][2]
                second_per_grid_t = 0
                image_index += 1
                remain_images -= 1
                ed = ed_image
            else:
                t, h, w = video_grid_thw[video_index][0], video_grid_thw[video_index][1], video_grid_thw[video_index][2]
                second_per_grid_t = second_per_grid_ts[video_index] if second_per_grid_ts is not None else 1.0
                video_index += 1
                remain_videos -= 1
                ed = ed_video

            llm_grid_t, llm_grid_h, llm_grid_w = t.item(), h.item() // spatial_merge_size, w.item() // spatial_merge_size
            text_len = ed - st

            st_idx = llm_pos_ids_list[-1].max() + 1 if len(llm_pos_ids_list) > 0 else 0
            llm_pos_ids_list.append(torch.arange(text_len).view(1, -1).expand(3, -1) + st_idx)

            t_index = torch.arange(llm_grid_t).view(-1, 1).expand(-1, llm_grid_h * llm_grid_w)
            t_index = (t_index * second_per_grid_t * tokens_per_second).long().flatten()
            h_index = torch.arange(llm_grid_h).view(1, -1, 1).expand(llm_grid_t, -1, llm_grid_w).flatten()
            w_index = torch.arange(llm_grid_w).view(1, 1, -1).expand(llm_grid_t, llm_grid_h, -1).flatten()
            llm_pos_ids_list.append(torch.stack([t_index, h_index, w_index]) + text_len + st_idx)
            st = ed + llm_grid_t * llm_grid_h * llm_grid_w

        if st < len(input_tokens):
            st_idx = llm_pos_ids_list[-1].max() + 1 if len(llm_pos_ids_list) > 0 else 0
            text_len = len(input_tokens) - st
            llm_pos_ids_list.append(torch.arange(text_len).view(1, -1).expand(3, -1) + st_idx)

        llm_positions = torch.cat(llm_pos_ids_list, dim=1).reshape(3, -1)
        position_ids[..., attention_mask == 1] = llm_positions.to(position_ids.device)
    else:
        if attention_mask is not None:
            position_ids = attention_mask.long().cumsum(-1) - 1
            position_ids.masked_fill_(attention_mask == 0, 1)
            position_ids = position_ids.unsqueeze(0).expand(3, -1).to(input_ids.device)
        else:
            position_ids = torch.arange(input_ids.shape[1], device=input_ids.device).view(1, -1).expand(3, -1)
    return position_ids


# ---- a Qwen2-VL processor, trimmed (Qwen2VLProcessor.__call__): expand <|image_pad|>, tokenize ----
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]
WORDS = ["system", "user", "assistant", "You", "are", "a", "helpful", "what", "is", "in", "the", "picture", "?",
         "count", "objects", "and", "colors", "describe", "it", "two", "red", "cats", "one", "blue", "box", "."]


def build_tokenizer():
    vocab = {t: i for i, t in enumerate(SPECIALS + WORDS + ["[UNK]"])}
    tk = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tk.pre_tokenizer = pre_tokenizers.Split(pattern=" ", behavior="removed")
    return PreTrainedTokenizerFast(tokenizer_object=tk, pad_token="<|endoftext|>", additional_special_tokens=SPECIALS[1:])


class Qwen2VLProcessor:
    def __init__(self, image_processor, tokenizer):
        self.image_processor = image_processor
        self.tokenizer = tokenizer
        self.image_token = "<|image_pad|>"

    def __call__(self, text, images=None, return_tensors="pt"):
        image_inputs = self.image_processor(images=images, return_tensors="pt")
        image_grid_thw = image_inputs["image_grid_thw"]
        merge_length = self.image_processor.merge_size**2
        text = list(text)
        index = 0
        for i in range(len(text)):
            while self.image_token in text[i]:
                num_image_tokens = int(image_grid_thw[index].prod() // merge_length)
                text[i] = text[i].replace(self.image_token, "<|placeholder|>" * num_image_tokens, 1)
                index += 1
            text[i] = text[i].replace("<|placeholder|>", self.image_token)
        text_inputs = self.tokenizer(text, add_special_tokens=False, return_tensors=return_tensors)
        return {**text_inputs, **image_inputs}


# ---- verl/utils/dataset/rl_dataset.py, RLHFDataset.__getitem__ (trimmed) ----
class RLHFDataset:
    def __init__(self, rows, tokenizer, processor, max_prompt_length):
        self.rows, self.tokenizer, self.processor = rows, tokenizer, processor
        self.max_prompt_length = max_prompt_length
        self.truncation = "error"

    def __getitem__(self, item):
        row_dict = dict(self.rows[item])
        raw_prompt = row_dict.pop("prompt")
        images = row_dict.pop("images")
        model_inputs = self.processor(text=[raw_prompt], images=images, return_tensors="pt")
        input_ids = model_inputs.pop("input_ids")
        attention_mask = model_inputs.pop("attention_mask")
        row_dict["multi_modal_inputs"] = dict(model_inputs)

        input_ids, attention_mask = postprocess_data(
            input_ids=input_ids,
            attention_mask=attention_mask,
            max_length=self.max_prompt_length,
            pad_token_id=self.tokenizer.pad_token_id,
            left_pad=True,
            truncation=self.truncation,
        )

        if FIXED:
            is_qwen2vl = self.processor is not None and "Qwen2VLImageProcessor" in self.processor.image_processor.__class__.__name__
        else:
            is_qwen2vl = self.processor is not None and self.processor.image_processor.__class__.__name__ == "Qwen2VLImageProcessor"
        if is_qwen2vl:
            position_ids = [
                get_rope_index(
                    self.processor,
                    input_ids=input_ids[0],
                    image_grid_thw=model_inputs.get("image_grid_thw"),
                    video_grid_thw=model_inputs.get("video_grid_thw"),
                    second_per_grid_ts=model_inputs.get("second_per_grid_ts"),
                    attention_mask=attention_mask[0],
                )
            ]  # (1, 3, seq_len)
        else:
            position_ids = compute_position_id_with_mask(attention_mask)

        row_dict["input_ids"] = input_ids[0]
        row_dict["attention_mask"] = attention_mask[0]
        row_dict["position_ids"] = position_ids[0]
        return row_dict


def collate_fn(data_list):
    batch = {}
    for key in ("input_ids", "attention_mask", "position_ids"):
        batch[key] = torch.stack([d[key] for d in data_list], dim=0)
    batch["multi_modal_inputs"] = np.array([d["multi_modal_inputs"] for d in data_list], dtype=object)
    return batch


# ---- vllm_rollout_spmd.generate_sequences: append the sampled responses and their positions ----
def append_responses(batch, responses, eos_token_id, pad_token_id):
    idx, attention_mask, position_ids = batch["input_ids"], batch["attention_mask"], batch["position_ids"]
    batch_size = idx.size(0)
    response_length = responses.size(1)
    seq = torch.cat([idx, responses], dim=-1)
    delta_position_id = torch.arange(1, response_length + 1, device=position_ids.device)
    delta_position_id = delta_position_id.unsqueeze(0).expand(batch_size, -1)
    if position_ids.dim() == 3:  # qwen2vl mrope
        delta_position_id = delta_position_id.view(batch_size, 1, -1).expand(batch_size, 3, -1)
    response_position_ids = position_ids[..., -1:] + delta_position_id
    position_ids = torch.cat([position_ids, response_position_ids], dim=-1)
    # get_response_mask: ones up to and including the first eos
    eos = (responses == eos_token_id).long()
    response_attention_mask = (torch.cumsum(eos, dim=1) - eos).eq(0).long()
    attention_mask = torch.cat((attention_mask, response_attention_mask), dim=-1)
    batch.update(prompts=idx, responses=responses, input_ids=seq, attention_mask=attention_mask, position_ids=position_ids)
    return batch


# ---- verl/workers/actor/dp_actor.py, DataParallelPPOActor._forward_micro_batch (use_remove_padding=False) ----
def forward_micro_batch(actor_module, micro_batch, temperature):
    response_length = micro_batch["responses"].size(-1)
    multi_modal_inputs = {}
    if "multi_modal_inputs" in micro_batch.keys():
        for key in micro_batch["multi_modal_inputs"][0].keys():
            multi_modal_inputs[key] = torch.cat([inputs[key] for inputs in micro_batch["multi_modal_inputs"]], dim=0)

    input_ids = micro_batch["input_ids"]
    attention_mask = micro_batch["attention_mask"]
    position_ids = micro_batch["position_ids"]
    if position_ids.dim() == 3:  # qwen2vl mrope
        position_ids = position_ids.transpose(0, 1)  # (bsz, 3, seqlen) -> (3, bsz, seqlen)

    output = actor_module(
        input_ids=input_ids,
        attention_mask=attention_mask,
        position_ids=position_ids,
        **multi_modal_inputs,
        use_cache=False,
    )
    logits = output.logits
    logits.div_(temperature)
    logits = logits[:, -response_length - 1 : -1, :]
    log_probs = logprobs_from_logits(logits, micro_batch["responses"])
    return log_probs


def main():
    torch.manual_seed(0)
    tokenizer = build_tokenizer()
    image_processor = Qwen2VLImageProcessorPil()  # patch 14, merge 2, temporal patch 2
    processor = Qwen2VLProcessor(image_processor, tokenizer)
    tid = tokenizer.convert_tokens_to_ids

    config = Qwen2VLConfig(
        text_config=dict(
            vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, initializer_range=0.1,
            rope_parameters={"rope_type": "default", "rope_theta": 100.0, "mrope_section": [2, 3, 3]},
            pad_token_id=tid("<|endoftext|>"), bos_token_id=None, eos_token_id=tid("<|im_end|>"),
        ),
        vision_config=dict(depth=1, embed_dim=32, hidden_size=64, num_heads=2, mlp_ratio=2, in_channels=3,
                           patch_size=14, spatial_merge_size=2, temporal_patch_size=2),
        image_token_id=tid("<|image_pad|>"), video_token_id=tid("<|video_pad|>"),
        vision_start_token_id=tid("<|vision_start|>"), vision_end_token_id=tid("<|vision_end|>"),
    )
    config._attn_implementation = "sdpa"
    actor = Qwen2VLForConditionalGeneration(config).eval()

    rng = np.random.RandomState(0)
    rows = [
        {"prompt": "<|im_start|> user <|vision_start|><|image_pad|><|vision_end|> what is in the picture ? <|im_end|> <|im_start|> assistant",
         "images": [(rng.rand(56, 84, 3) * 255).astype(np.uint8)]},
        {"prompt": "<|im_start|> system You are a helpful assistant <|im_end|> <|im_start|> user <|vision_start|><|image_pad|><|vision_end|> count objects and colors in the picture ? <|im_end|> <|im_start|> assistant",
         "images": [(rng.rand(84, 56, 3) * 255).astype(np.uint8)]},
    ]
    dataset = RLHFDataset(rows, tokenizer, processor, max_prompt_length=40)
    batch = collate_fn([dataset[i] for i in range(len(rows))])

    responses = torch.tensor([
        tokenizer(" two red cats . <|im_end|> <|endoftext|> <|endoftext|> <|endoftext|>", add_special_tokens=False)["input_ids"],
        tokenizer(" one blue box and two cats . <|im_end|>", add_special_tokens=False)["input_ids"],
    ])
    batch = append_responses(batch, responses, eos_token_id=tid("<|im_end|>"), pad_token_id=tokenizer.pad_token_id)

    with torch.no_grad():
        old_log_prob = forward_micro_batch(actor, batch, temperature=1.0)
    response_mask = batch["attention_mask"][:, -responses.size(1):]
    print("position_ids shape:", tuple(batch["position_ids"].shape))
    print("old_log_prob (response tokens):")
    print((old_log_prob * response_mask).numpy().round(4))
    print("mean log-prob:", float((old_log_prob * response_mask).sum() / response_mask.sum()))


if __name__ == "__main__":
    main()
