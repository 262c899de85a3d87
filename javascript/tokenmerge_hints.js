// Hover hints for the ToMe accordion, keyed by control label like the webui's own `titles`.
(function() {
    const hints = {
        "Token merging (ToMe)": "Merge similar tokens inside the U-Net's attention for this generation: faster and lighter on memory at high resolutions, with a small change in detail. The same infotext gives the same image.",
        "Merge ratio": "Fraction of tokens merged in each patched block. 0.5 is a good start; higher is faster but loses detail. The stride caps it (0.75 at 2x2); above the cap the capped value is used and recorded.",
        "Hires fix only": "Leave the first pass alone and merge only in the hires fix pass, where the token count, and so the gain, is largest.",
        "Hires merge ratio (0 = same)": "Merge ratio of the hires fix pass; 0 uses the merge ratio.",
        "Merge method": "ToMe merges similar tokens before attention and restores them after. ToDo keeps every token but lets self-attention look at a downsampled copy of them. Local merges alike tokens within 2x2 windows, with one plan per U-Net level: the lowest overhead, the largest change to the picture.",
        "ToMe": "Token merging: merge similar tokens before attention (and optionally the MLP), unmerge after.",
        "ToDo": "Token downsampling: self-attention keeps every query but uses keys and values from a downsampled token grid.",
        "Local": "Local merging: in every 2x2 window of tokens the most alike ones merge, by one plan per U-Net level that every patched block of the level uses. The lowest overhead, but measured so far it changes the picture more than ToMe or ToDo at the same speed.",
        "Merge levels (max downsample)": "Which U-Net levels are patched. auto: the highest-resolution level that has attention (also right for SDXL). 1/2/4/8: every level up to that downsampling factor; more levels are faster but change the image more.",
        "Stride x": "Width of the cell that keeps one destination token; a larger cell allows a higher ratio (cap 1 - 1/(x*y)).",
        "Stride y": "Height of the cell that keeps one destination token; a larger cell allows a higher ratio (cap 1 - 1/(x*y)).",
        "Random partition": "Pick the destination token of each cell at random (derived from the seed, so still reproducible). Off: always the same position, as in the webui's built-in token merging.",
        "Merge cross-attention": "Also merge tokens before cross-attention (the prompt): a little faster, more loss of detail.",
        "Merge MLP": "Also merge tokens before the feed-forward layer: faster, noticeably more loss of detail.",
        "ToDo factor": "ToDo: keys and values come from a grid this many times smaller per side.",
        "ToDo pooling": "ToDo: how each window of tokens becomes one; nearest keeps one token, average takes their mean.",
        "Re-plan every (steps)": "Local: find which tokens merge every this many sampling steps and reuse that plan in between. 1: every step.",
        "Start at (fraction of steps)": "Merge from this fraction of the sampling steps on (of each pass). 0: from the first step.",
        "End at (fraction of steps)": "Merge up to this fraction of the sampling steps (of each pass). 1: to the last step."
    };

    function addHints() {
        Object.assign(titles, hints);
    }

    if (typeof titles === "object") {
        addHints();
    } else if (typeof onUiLoaded === "function") {
        onUiLoaded(addHints);
    }
})();
