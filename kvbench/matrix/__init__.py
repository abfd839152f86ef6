"""The cluster link matrix (`kvbench matrix`): every ordered pair of ranks measured with the
p2p engine (kvbench.p2p.patterns.matrix), fitted pair by pair (kvbench.fit), reported as a
heatmap and tables, with a verdict naming the slow pairs and the pairs on an odd path."""
