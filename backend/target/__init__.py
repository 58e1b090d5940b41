"""toptpu.backend.target: the target description — what the chip is (presets in
`chips.json`) and what things cost on it (`cost`). No passes, no IR rewriting."""
