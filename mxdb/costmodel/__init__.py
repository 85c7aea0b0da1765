"""A learned performance model: predicts a config's GPU time relative to FlagGems' choice at a
(shape, token count, routing class) key, so that mxdb can answer shape families it never
measured (dispatch level ``predicted``) and the tuner can order and prune its first rung.

* :mod:`mxdb.costmodel.menu`: the candidate configs a prediction chooses from, and the extra
  configs a sweep times for coverage.
* :mod:`mxdb.costmodel.features`: the feature vector of a (key, config) pair.
* :mod:`mxdb.costmodel.trees`: the trained model as plain data (tree ensembles or a linear
  model), evaluated without scikit-learn.
* :mod:`mxdb.costmodel.calibration`: the map from predicted gain to the measured win rate.
* :mod:`mxdb.costmodel.model`: a loaded model: its best config for a key, with a confidence.
* :mod:`mxdb.costmodel.train`: training, leave-one-family-out validation and the choice of
  model class (needs scikit-learn, the ``model`` extra).
"""
