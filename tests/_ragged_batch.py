"""A ragged prompt + completion batch in TRL's layout, for the packing tests."""

import torch


def synthetic_ragged_batch(
    B: int, P: int, K: int, vocab: int, *, device="cpu", seed: int = 0, pad_id: int = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    """ids, mask (B, P + K) shaped like TRL's: prompts of P − ⌊P·b/2B⌋ tokens left-padded to P,
    completions of ⌈K·(b+1)/B⌉ tokens right-padded to K (b = 0…B−1, each shuffled): mean
    completion fill (B + 1)/2B, 56 % at B = 8, as in the end-to-end benchmark's batches."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, vocab, (B, P + K), generator=g)  # 0, 1, 2: pad / bos / eos
    c_len = torch.tensor([-(-K * (b + 1) // B) for b in range(B)])
    c_len = c_len[torch.randperm(B, generator=g)]
    p_len = (P - P * torch.arange(B) // (2 * B))[torch.randperm(B, generator=g)]
    col = torch.arange(P + K)
    mask = ((col[None] >= P - p_len[:, None]) & (col[None] < P + c_len[:, None])).long()
    ids[mask == 0] = pad_id
    return ids.to(device), mask.to(device)
