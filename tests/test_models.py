"""The article's networks, fixed: flatten size from shapes; MLP stage splitting."""

from __future__ import annotations

import pytest
import torch

from mgtutorial.common import models


def test_flatten_size_from_shapes():
    assert models.cnn_flatten_size((3, 32, 32)) == 32 * 14 * 14 == 6272
    assert models.cnn_flatten_size((1, 28, 28)) == 4608  # the article's number fits 28×28 only
    with pytest.raises(ValueError, match="too small"):
        models.cnn_flatten_size((3, 4, 4))


def test_cnn_shapes_and_wrong_flatten_size_error():
    model = models.ArticleCNN((3, 32, 32), num_classes=10)
    assert model(torch.randn(5, 3, 32, 32)).shape == (5, 10)
    wrong = models.ArticleCNN((3, 32, 32), flatten_size=4608)
    with pytest.raises(ValueError, match="produced 6272 features per image but fc1 expects 4608"):
        wrong(torch.randn(4, 3, 32, 32))


def test_mlp_split_matches_whole_model():
    torch.manual_seed(0)
    mlp = models.ArticleMLP()
    x = torch.randn(6, 1024)
    for n in (1, 2, 3):
        stages = mlp.split(n)
        assert len(stages) == n
        out = x
        for stage in stages:
            out = stage(out)
        torch.testing.assert_close(out, mlp(x))
        assert sum(models.count_parameters(s) for s in stages) == models.count_parameters(mlp)
    assert [len(s) for s in mlp.split(2)] == [2, 1]
    with pytest.raises(ValueError, match="num_stages=4"):
        mlp.split(4)


def test_mlp_sizes():
    mlp = models.ArticleMLP()
    assert mlp(torch.randn(2, 1024)).shape == (2, 100)
    assert models.count_parameters(mlp) == 1024 * 512 + 512 + 512 * 256 + 256 + 256 * 100 + 100


def test_mlp_without_relu_is_the_articles_linear_map():
    # the article's sub-networks are a Linear each, nothing between: one linear map in all
    torch.manual_seed(0)
    article, course = models.ArticleMLP(relu=False), models.ArticleMLP()
    assert [s.relu for s in article.subnets] == [False, False, False]
    assert [s.relu for s in course.subnets] == [True, True, False]  # the course adds the ReLUs
    weight, bias = torch.eye(1024), torch.zeros(1024)
    for s in article.subnets:
        weight, bias = s.linear.weight @ weight, s.linear.weight @ bias + s.linear.bias
    x = torch.randn(8, 1024)
    with torch.no_grad():
        torch.testing.assert_close(article(x), x @ weight.T + bias, atol=1e-5, rtol=1e-4)
        course.load_state_dict(article.state_dict())  # the same parameters, the ReLUs between
        assert (course(x) - (x @ weight.T + bias)).abs().max() > 1e-2
