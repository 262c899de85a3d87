// Hover hints for the ToMe accordion, keyed by control label like the webui's own `titles`.
(function() {
    const hints = {
        "Token merging (ToMe)": "Merge similar tokens inside the U-Net's attention for this generation: faster and lighter on memory at high resolutions, with a small change in detail. The same infotext gives the same image.",
        "Merge ratio": "Fraction of tokens merged in each patched block (Local: of self-attention's keys and values left out; Stack: of the tokens each transformer stack runs on; ToDo uses its factor instead). 0.5 is a good start; higher is faster but loses detail. The stride caps it (0.75 at 2x2, and for Local and Stack); above the cap the capped value is used and recorded.",
        "Hires fix only": "Leave the first pass alone and merge only in the hires fix pass, where the token count, and so the gain, is largest.",
        "Hires merge ratio (0 = same)": "Merge ratio of the hires fix pass; 0 uses the merge ratio.",
        "Merge method": "ToMe merges similar tokens before attention and restores them after. ToDo keeps every token but lets self-attention look at a downsampled copy of them. Local also keeps every token, and lets self-attention look at one token of each group of alike tokens within 2x2 windows (one plan per U-Net level): the most faithful at the speeds it reaches. Stack merges the tokens once for a whole transformer (attention, cross-attention and MLP of every block) and gives each token its change back: the fastest by far (on SDXL use it with Merge levels 4), and the one that changes the picture most at the same speed. Cache runs the transformers whole on some steps and, on the steps between, gives every token its output from the last full step, moved as its input has moved: on SDXL about as fast as Stack and far closer to the unmerged picture.",
        "ToMe": "Token merging: merge similar tokens before attention (and optionally the MLP), unmerge after.",
        "ToDo": "Token downsampling: self-attention keeps every query but uses keys and values from a downsampled token grid.",
        "Local": "Local merging: every token keeps its own query; in every 2x2 window the most alike tokens form groups (the ratio says how many merge), and self-attention's keys and values come from one token of each group. One plan per U-Net level serves every patched block of the level. At ratio 0.75 it equals ToDo factor 2; below, it is slower and changes the picture less.",
        "Stack": "Stack merging: at each patched transformer's entrance the most alike tokens of every 2x2 window are averaged into groups (the ratio says how many), every block of the transformer runs on the groups, and at its exit each token keeps its own input plus what the transformer added to its group. One plan per U-Net level. On SDXL choose Merge levels 4, so that its deep second level is merged too.",
        "Cache": "Step caching: no token is merged. The transformers of the patched levels (auto: all but the highest-resolution one, SDXL's deep level) run whole on the first steps and then on steps ever further apart; on the steps between they are skipped, and every token gets the transformers' output from the last full step, moved by as much of its input's move as the transformers pass on (measured between full steps). What is kept takes memory (63 MB for SDXL at 1024 px in float16, cond and uncond). For SDXL; with Merge levels 4 (both levels) it gains more but moves the picture more than ToDo.",
        "Merge levels (max downsample)": "Which U-Net levels are patched. auto: the highest-resolution level that has attention (also right for SDXL). 1/2/4/8: every level up to that downsampling factor; more levels are faster but change the image more.",
        "Stride x": "Width of the cell that keeps one destination token; a larger cell allows a higher ratio (cap 1 - 1/(x*y)).",
        "Stride y": "Height of the cell that keeps one destination token; a larger cell allows a higher ratio (cap 1 - 1/(x*y)).",
        "Random partition": "Pick the destination token of each cell at random (derived from the seed, so still reproducible). Off: always the same position, as in the webui's built-in token merging.",
        "Merge cross-attention": "Also merge tokens before cross-attention (the prompt): a little faster, more loss of detail.",
        "Merge MLP": "Also merge tokens before the feed-forward layer: faster, noticeably more loss of detail.",
        "ToDo factor": "ToDo: keys and values come from a grid this many times smaller per side.",
        "ToDo pooling": "ToDo: how each window of tokens becomes one; nearest keeps one token, average takes their mean.",
        "Re-plan every (steps)": "Local and Stack: find which tokens group every this many sampling steps and reuse that plan in between. 1: every step.",
        "Longest gap (Cache)": "Cache: after the first full steps, the transformers run whole on steps ever further apart (2, 4, 6 ... steps apart, up to this many) and reuse their change on the steps between. 1: every step full (no gain); 8: with 2 steps first, steps 1, 2, 4, 8, 14, 22, 30 ... run whole.",
        "Full steps first (Cache)": "Cache: the first this many sampling steps run whole, where the picture still changes most, before reuse begins.",
        "Size-weighted keys": "ToMe and Local: a key that stands for a group of k tokens weighs k times in self-attention, as if its tokens were there one by one (proportional attention). Auto: on for ToMe, off for Local, as the benchmark measured closer to the unmerged picture. Off: the paper's ToMe for SD (tomesd's pictures).",
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
