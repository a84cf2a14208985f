"""The explorer's page templates (Jinja2, autoescaped: every user or corpus text is escaped).

Kept as strings in a module so that they install with the package, like any code.
The `*_fragment` templates are also what notebooks show (`_repr_html_`). Layers are shown,
linked and typed counted from 1 (`ln`, `ffkv.presentation.style.layer_number`).
"""

TEMPLATES = {
"base.html": """<!doctype html>
<html lang="en"><head><meta charset="utf-8"><meta name="viewport" content="width=device-width, initial-scale=1">
<link rel="icon" href="data:,"><title>{% block title %}ffkv explorer{% endblock %} · {{ run_name }}</title>
<style>{{ css }}</style></head>
<body><header class="top"><a href="{{ root }}/">ffkv · {{ run_name }}</a><a href="{{ root }}/search">Search</a>
<a href="{{ root }}/trace">Trace</a><a href="{{ root }}/concepts">Concepts</a>{% if has_report %}<a href="{{ root }}/files/report.html">Report</a>{% endif %}
<span class="small muted">layers {% for i in range(n_layers) %}<a href="{{ root }}/layer/{{ ln(i) }}" style="margin-right:.4rem">{{ ln(i) }}</a>{% endfor %}{% if latent_layers is defined and latent_layers %} · latents {% for name in latent_layers %}<a href="{{ root }}/layer/{{ name }}" style="margin-right:.4rem" class="latent-layer">{{ name }}</a>{% endfor %}{% endif %}</span></header>
<main>{% block main %}{% endblock %}</main></body></html>""",

"error.html": """{% extends "base.html" %}{% block title %}{{ status }}{% endblock %}
{% block main %}<h1>{{ status }} · {{ reason }}</h1><p class="error" id="error-message">{{ message }}</p>
<p><a href="{{ root }}/">Back to the overview</a></p>{% endblock %}""",

"overview.html": """{% extends "base.html" %}{% block title %}overview{% endblock %}
{% block main %}<h1>Run {{ run_name }}</h1>
<dl class="run">{% for k, v in run_rows %}<dt>{{ k }}</dt><dd>{{ v }}</dd>{% endfor %}</dl>
<p class="note" id="numbering">{{ numbering }}</p>
<nav class="toc small" id="contents"><strong>Contents:</strong> {% if fidelity %}<a href="#fidelity-heading">does this model reproduce the paper?</a> · {% endif %}{% if massive %}<a href="#massive">massive activations</a> · {% endif %}<a href="#layers">layers</a>{% if dictionaries %} · <a href="#dictionary">sparse dictionary</a>{% endif %}{% if beside %} · <a href="#latents-beside">latents beside neurons</a>{% endif %} · <a href="#figures">figures</a></nav>
{% if fidelity %}<h2 id="fidelity-heading">Does this model reproduce the paper?</h2>
<div class="scroll">{{ table(fidelity, "fidelity", "fidelity", root) }}</div>{% endif %}
{% if massive %}<h2 id="massive">Massive activations</h2>
<p class="note">Analysed positions whose coefficients are massive (their RMS over the layer's memories more than 20 times the
median position's; Sun et al. 2024): left out of the active rule's scale s_l (docs/definitions.md), named here.</p>
<div class="scroll">{{ table(massive, "massive", "", root) }}</div>{% endif %}
<h2 id="layers">Layers</h2>
<p class="note" id="layers-note">Per layer, over its keys: agreement, of the keys whose top-1 trigger example has a trigger target (keys with a target), the share whose value's top token (identity projection, as in the
paper) is that target, as Figure 4 counts it; active, the mean
share of positions of a corpus sample ({{ sample_positions }} positions) where a key is active (m &gt; 0 for ReLU models, |m| &gt; tau·s_l otherwise; docs/definitions.md); the shares of the
automatic pattern labels{% if not has_labels %} (after <code>ffkv analyze</code>){% endif %}, each label on its own: the shallow keys of the table above
(and of the report) are those labelled shallow or both.</p>
<div class="scroll">{{ table(layers, "layers", "", root) }}</div>
{% if dictionaries %}<h2 id="dictionary">Sparse dictionary</h2>
<p class="note" id="dictionary-note">This run was indexed with a sparse dictionary (docs/definitions.md): each latent is a memory of its own, with its own page (tLAYER:LATENT for a transcoder's, sLAYER:LATENT for an SAE's, layers from 1).
Dead: latents without a trigger example over the indexed corpus (the fidelity below counts those never active on its held-out tokens); active: the mean share of sample positions where a latent's activation is above 0; agreement as for the neurons, on the decoder rows, of the latents with a trigger target.</p>
<table id="dictionaries"><tr><th>dictionary</th><th>kind</th><th class="num">layer</th><th class="num">latents</th><th class="num">dead over the indexed corpus</th><th class="num">active</th><th class="num">agreement</th><th>neurons</th></tr>
{% for d in dictionaries %}<tr><td><a href="{{ root }}/layer/{{ d.name }}">{{ d.name }}</a></td><td>{{ d.kind }}</td><td class="num">{{ ln(d.layer) }}</td><td class="num">{{ "{:,}".format(d.latents) }}</td><td class="num">{{ "{:,}".format(d.dead) }}</td><td class="num">{{ pct(d.active, 2) }}</td><td class="num">{{ pct(d.agreement, 2) }}</td><td><a href="{{ root }}/layer/{{ ln(d.layer) }}">layer {{ ln(d.layer) }}</a></td></tr>{% endfor %}</table>{% endif %}
{% if beside %}<h2 id="latents-beside">Latents beside neurons</h2>
{% if beside.damaged %}{% for line in beside.damaged %}<p class="warning beside-damaged">Not shown: {{ line }}</p>{% endfor %}
{% elif beside.missing %}<p class="note" id="beside-missing">Not computed yet: <code>{{ beside.missing }}</code> sets each measure of the dictionary's latents beside the same layer's neurons, with the dictionary's fidelity.</p>
{% else %}<p class="note" id="beside-note">Each measure the latent studies computed, the dictionary's latents beside the same layer's neurons. Share: of those judged (n: memories, or examples), with its 95% interval; null: the kind's own (its control latents or random key directions, or chance; — where the measure has none).
Difference, in percentage points with its 95% interval (for the explanation score, a mean correlation, in its own units): latents minus neurons, or, where the line under it says excess, each kind's excess over its own null, latents minus neurons. Above 0 the latents are the higher on what that line names, which is better or worse by the measure (more dead latents is worse).
Verdict: the table's own{% if beside.rule %} ({{ beside.rule }}){% endif %}.{% if has_report %} Each measure links to its study in the report.{% endif %}</p>
{% for part in beside.layers %}<h3 id="beside-{{ part.name }}">{{ part.name }}: the {{ part.kind }}'s latents at layer {{ ln(part.layer) }}, beside that layer's neurons</h3>
<div class="beside">{% if part.fidelity %}{% set f = part.fidelity %}<div class="fidelity-beside" id="beside-fidelity-{{ part.name }}"><strong>Fidelity of {{ part.name }}</strong> over {{ f.tokens }} held-out tokens:
FVU <strong class="fvu">{{ f.fvu }}</strong> · dead on these tokens <strong class="dead">{{ f.dead }} of {{ f.latents }} ({{ f.dead_share }})</strong> · loss recovered <strong class="loss-recovered">{{ f.loss_recovered }}</strong>
<span class="what">FVU: the share of the FF output's variance the reconstruction leaves unexplained (0: exact). Dead: never active on these tokens. Loss recovered: (L<sub>mean</sub> − L<sub>spliced</sub>) / (L<sub>mean</sub> − L<sub>original</sub>), 1 where the layer's output replaced by the reconstruction does as well as the layer, 0 as badly as its mean output (next-token loss: original {{ f.loss_original }}, spliced {{ f.loss_spliced }}, mean-ablated {{ f.loss_mean_ablated }}).</span></div>
{% else %}<p class="muted small">No fidelity row for {{ part.name }}.</p>{% endif %}
<div class="scroll">{% if part.rows %}<table class="beside-table" id="beside-table-{{ part.name }}">
<tr><th rowspan="2">measure</th><th colspan="3" class="kind kind-latents">latents ({{ part.name }})</th><th colspan="3" class="kind kind-neurons">neurons (layer {{ ln(part.layer) }})</th><th rowspan="2" class="num">difference<br>[95% CI]</th><th rowspan="2">verdict</th></tr>
<tr><th class="num">share [95% CI]</th><th class="num">n</th><th class="num">null</th><th class="num">share [95% CI]</th><th class="num">n</th><th class="num">null</th></tr>
{% for r in part.rows %}<tr data-measure="{{ r.measure }}"><td class="measure">{% if r.link and has_report %}<a href="{{ root }}/files/report.html{{ r.link }}" title="{{ r.study }} in the report">{{ r.measure }}</a>{% else %}{{ r.measure }}{% endif %}<span class="what">{{ r.label }}</span></td>
{% for kind in ("latents", "neurons") %}{% set k = r[kind] %}<td class="num {{ kind }}-share">{{ k.share }}<span class="ci">[{{ k.low }}, {{ k.high }}]</span></td><td class="num {{ kind }}-n">{{ k.n }}</td><td class="num {{ kind }}-null">{{ k.null }}</td>{% endfor %}
<td class="num difference">{{ r.difference }}<span class="ci">[{{ r.difference_low }}, {{ r.difference_high }}]</span><span class="what">{{ r.difference_means }}</span></td><td class="verdict verdict-{{ r.side }}">{{ r.verdict }}</td></tr>{% endfor %}
</table>{% else %}<p class="muted">No measure of this layer's latents in the table.</p>{% endif %}</div></div>{% endfor %}
{% if beside_figure %}<figure id="beside-figure">{% if beside_figure.problem %}<p class="warning damaged-figure">Not shown: {{ beside_figure.problem }}</p>{% else %}<img src="{{ root }}/files/{{ beside_figure.path }}" alt="{{ beside_figure.name }}" loading="lazy">{% endif %}<figcaption class="small muted">{{ beside_figure.name }}</figcaption></figure>{% endif %}
{% endif %}{% endif %}
<h2 id="figures">Figures</h2>
{% if not figures %}<p class="muted" id="no-figures">No figures yet: run <code>ffkv analyze</code> on this run.</p>{% endif %}
{% for f in figures %}<section class="figure-block"><figure>{% if f.problem %}<p class="warning damaged-figure">Not shown: {{ f.problem }}</p>{% else %}<img src="{{ root }}/files/{{ f.path }}" alt="{{ f.name }}" loading="lazy">{% endif %}<figcaption class="small muted">{{ f.name }}</figcaption></figure>
<div>{% if f.finding %}<div class="finding"><strong>{{ heading(f.paper_figure) }}:</strong> {{ f.finding }}</div>{% endif %}</div></section>{% endfor %}
{% endblock %}""",

"layer.html": """{% extends "base.html" %}{% block title %}layer {{ ln(layer) }}{% endblock %}
{% block main %}<h1>Layer {{ ln(layer) }} <span class="muted small">of {{ n_layers }}</span></h1>
<p>{% if layer > 0 %}<a href="{{ root }}/layer/{{ ln(layer - 1) }}?sort={{ sort|urlencode }}&order={{ order }}">← layer {{ ln(layer - 1) }}</a>{% endif %}
{% if layer > 0 and layer + 1 < n_layers %} · {% endif %}{% if layer + 1 < n_layers %} <a href="{{ root }}/layer/{{ ln(layer + 1) }}?sort={{ sort|urlencode }}&order={{ order }}">layer {{ ln(layer + 1) }} →</a>{% endif %}{% if latent_name %} · <a href="{{ root }}/layer/{{ latent_name }}" id="latents-link">this layer's latents ({{ latent_name }})</a>{% endif %}</p>
<p class="note">{{ "{:,}".format(n_keys) }} keys, sorted by {{ sort }} ({{ "descending" if order == "desc" else "ascending" }}); rows {{ first }}–{{ last }}, page {{ page }} of {{ n_pages }}.
Click a column's name to sort by it. Pattern: the automatic label of <code>ffkv analyze</code> (thresholds in the report); human: the latest label saved in the explorer.
Value's top tokens and agreement under the identity projection; active: share of positions of a corpus sample where the key is active (m &gt; 0 for ReLU models, |m| &gt; tau·s_l otherwise; docs/definitions.md).</p>
{% if signed %}<p class="note" id="signed-note">Largest m: the key's strongest trigger example; strength m &lt; 0: -m of its most negative one (0 when even that is positive). Where m &lt; 0 the memory adds -|m|·v: it raises its value's bottom tokens and lowers its top ones.</p>{% endif %}
{% if census_filters %}<p class="small" id="census-filter">Census (<code>ffkv analyze --only census</code>; docs/definitions.md): {% if census %}<a href="{{ root }}/layer/{{ ln(layer) }}">all keys</a>{% else %}<strong>all keys</strong>{% endif %}{% for group, filters in census_filters %} · {% if group %}{{ group }}: {% endif %}{% for f, label in filters %}{% if not loop.first %}, {% endif %}{% if f == census %}<strong>{{ label }}</strong>{% else %}<a href="{{ root }}/layer/{{ ln(layer) }}?census={{ f }}">{{ label }}</a>{% endif %}{% endfor %}{% endfor %}</p>{% endif %}
{% if scored %}<form method="get" action="{{ root }}/layer/{{ ln(layer) }}" id="score-filter" class="small"><p>Explanations (<code>ffkv explain</code>, scored by simulation with <code>ffkv score</code>; docs/explain.md): keep memories whose explanation scores at least
<input type="number" name="min_score" min="-1" max="1" step="0.05" value="{{ min_score }}" placeholder="-1 to 1">{% if census %}<input type="hidden" name="census" value="{{ census }}">{% endif %}<input type="hidden" name="sort" value="explanation score"><input type="hidden" name="order" value="desc">
<button type="submit">Filter</button>{% if min_score %} · <a href="{{ root }}/layer/{{ ln(layer) }}{% if census %}?census={{ census }}{% endif %}">every memory</a>{% endif %} · find memories by their explanation's words in <a href="{{ root }}/search">search</a>.</p></form>{% endif %}
<div class="scroll long"><table id="keys"><tr>{% for c in columns %}<th{% if c.num %} class="num"{% endif %}>{% if c.sort %}<a href="{{ root }}/layer/{{ ln(layer) }}?sort={{ c.sort|urlencode }}&order={{ 'asc' if c.sort == sort and order == 'desc' else 'desc' }}{{ kept }}"{% if c.sort == sort %} class="on"{% endif %}>{{ c.title }}{% if c.sort == sort %} {{ "▼" if order == "desc" else "▲" }}{% endif %}</a>{% else %}{{ c.title }}{% endif %}</th>{% endfor %}</tr>
{% for row in rows %}<tr>{% for cell in row %}<td class="{{ cell.cls }}">{% if cell.href %}<a href="{{ root }}{{ cell.href }}">{{ cell.text }}</a>{% elif cell.tokens %}{% for t in cell.tokens %}{{ tok(t) }} {% endfor %}{% elif cell.label %}<span class="label-{{ cell.label }}">{{ cell.label }}</span>{% else %}{{ cell.text }}{% endif %}</td>{% endfor %}</tr>{% endfor %}
</table></div>
<p>{% if page > 1 %}<a href="{{ root }}/layer/{{ ln(layer) }}?sort={{ sort|urlencode }}&order={{ order }}&page=1{{ kept }}" id="first-page">« first</a>
<a href="{{ root }}/layer/{{ ln(layer) }}?sort={{ sort|urlencode }}&order={{ order }}&page={{ page - 1 }}{{ kept }}" id="previous-page">← previous</a>{% endif %}
{% if page < n_pages %} <a href="{{ root }}/layer/{{ ln(layer) }}?sort={{ sort|urlencode }}&order={{ order }}&page={{ page + 1 }}{{ kept }}" id="next-page">next →</a>
<a href="{{ root }}/layer/{{ ln(layer) }}?sort={{ sort|urlencode }}&order={{ order }}&page={{ n_pages }}{{ kept }}" id="last-page">last »</a>{% endif %}</p>
{% endblock %}""",


"explanations.html": """{% if explanations %}<div id="explanations"><strong>Explanation{% if explanations|length > 1 %}s{% endif %}</strong> (<code>{{ explain_command }}</code>, scored by <code>ffkv score</code>):<ul>{% for x in explanations %}<li>{% if x.direction < 0 %}<span class="chip">negative</span> {% endif %}{{ x.explanation }} <span class="small muted">by {{ x.explainer }}{% if x.score is not none %}; score {{ "%.2f"|format(x.score) }}{% if x.shuffled_score is not none %} (shuffled {{ "%.2f"|format(x.shuffled_score) }}){% endif %} by {{ x.simulator }}{% else %}; not scored yet{% endif %}</span></li>{% endfor %}</ul></div>{% endif %}
""",

"memory_fragment.html": """<div class="ffkv-memory">{% if standalone %}<style>{{ css }}</style>{% endif %}
<h1>Memory {{ ln(m.layer) }}:{{ m.key }} <span class="muted small">layer {{ ln(m.layer) }} of {{ n_layers }}, key {{ m.key }}</span></h1>
<p>{% if m.key > 0 %}<a href="{{ root }}/memory/{{ ln(m.layer) }}/{{ m.key - 1 }}">← key {{ m.key - 1 }}</a> · {% endif %}<a href="{{ root }}/layer/{{ ln(m.layer) }}">layer {{ ln(m.layer) }}</a>{% if m.key + 1 < d_m %} · <a href="{{ root }}/memory/{{ ln(m.layer) }}/{{ m.key + 1 }}">key {{ m.key + 1 }} →</a>{% endif %}
· <a href="{{ root }}/memory/{{ ln(m.layer) }}/{{ m.key }}.json?projection={{ m.projection }}&amp;shown={{ m.value.shown }}" id="json-link">JSON</a></p>
{% if match %}<p id="compare-match" class="small"><strong>Matched memory</strong> (<code>ffkv compare</code>): {{ match.model_b }} memory <code title="/memory/{{ ln(match.layer) }}/{{ match.key }} of `ffkv serve {{ match.run_b }}`">{{ ln(match.layer) }}:{{ match.key }}</code>, correlation {{ "%.3f"|format(match.correlation) }}, excess over a random rotation {{ "%.3f"|format(match.excess) }}{% if match.universal %} <span class="chip">universal</span>{% endif %}</p>{% endif %}
<h2>Pattern</h2>
<div id="pattern">
{% if m.auto %}<p><strong>Automatic (ffkv analyze):</strong> {% if m.auto.label %}<span class="label-{{ m.auto.label }}" id="auto-label">{{ m.auto.label }}</span>{% endif %}
{% if m.auto.description %} — {{ m.auto.description }}{% endif %}</p>
<p class="small" id="pattern-scores">{% for name, v, is_token in pattern_scores %}<span class="chip">{{ name }} {% if is_token %}{{ tok(v) }}{% else %}{{ v }}{% endif %}</span>{% endfor %}</p>
{% if label_reasons %}<ul class="small" id="label-why">{% for r in label_reasons %}<li>{{ r }}</li>{% endfor %}</ul>{% endif %}
{% else %}<p class="muted">No automatic label yet: <code>ffkv analyze --only patterns</code>.</p>
<p><strong>Surface:</strong> {{ pct(m.surface.share) }} of the top prefixes end in {{ tok(m.surface.token) }}.</p>{% endif %}
{% with explanations = m.explanations, explain_command = "ffkv explain" %}{% include "explanations.html" %}{% endwith %}
{% if m.census %}<p id="census-badge"><strong>Census:</strong> <span class="chip label-{{ m.census.census_class }}">{{ m.census.census_class }}</span>
<span class="chip">value: {{ m.census.census_value_type }}{% if m.census.census_firing_sign < 0 %} (fires with m &lt; 0: reads -v){% endif %}</span>{% if m.census.census_eraser %}<span class="chip">eraser</span>{% endif %}{% if m.census.census_two_way %}<span class="chip">fires both ways</span>{% endif %}
{% if m.census.census_rule %}<span class="small">best token rule for its strong activations over the census's corpus sample (not its top trigger examples, which the pattern above reads): {{ m.census.census_rule }} (F1 {{ pct(m.census.census_rule_f1) }})</span>{% endif %}
<span class="small muted">position explains {{ pct(m.census.census_position_eta2) }} of m's variance</span></p>{% endif %}
{% for h in m.human %}<p class="human-label"><strong>Human ({{ h.annotator }}, {{ h.time }}):</strong> <span class="label-{{ h.label }}">{{ h.label }}</span>{% if h.description %} — <span class="human-description">{{ h.description }}</span>{% endif %}</p>{% endfor %}
</div>
<h2>Value</h2>
<p class="switch" id="projection-switch">Read the value {% for p, s, label in projections %}{% if p == m.projection and s == m.value.shown %}<span class="on">{{ label }}</span>{% else %}<a href="?projection={{ p }}&amp;shown={{ s }}#projection-switch">{{ label }}</a>{% endif %}{% endfor %}</p>
<p class="note" id="value-numbers">{{ projection_note }} Under this projection the top token has {% if m.value.top_value is none %}p = {{ pct(m.stats.confidence) }} (identity){% elif m.value.shown == "p" %}p = {{ pct(m.value.top_value) }} (uniform: {{ pct(uniform) }}){% else %}logit {{ value_fmt(m.value.top_value) }}{% endif %};
the top-1 trigger's {{ target_name }} ranks {% if m.value.target_rank is not none %}{{ m.value.target_rank }}{% if m.value.target_rank == 1 %}: it <strong>is</strong> the value's top token{% endif %}{% else %}— (none){% endif %}; ‖v‖ = {{ fmt(m.stats.value_norm) }}.
Tokens read as they add to a text: a leading space marks a word start.</p>
{% if m.value.uniform %}<p class="warning" id="uniform-note">Under this projection the distribution is indistinguishable from uniform: its entropy is {{ pct(m.value.entropy_share, 2) }} of the largest a distribution over the vocabulary can have (uniform: 100%), and its top token has {{ "%.2f"|format(m.value.top_p / uniform) }}× the uniform probability: nothing in it stands out (docs/definitions.md, "Projections"). Read it under another projection.</p>{% endif %}
{% if signed %}<p class="note" id="directions">The memory adds m·v. Where m &gt; 0 (its strongest trigger example: m = {{ fmt(strongest.positive) }}) it promotes the top tokens and suppresses the bottom ones;
where m &lt; 0 ({% if strongest.negative is not none and strongest.negative < 0 %}down to m = {{ fmt(strongest.negative) }}{% else %}none of its trigger examples goes below 0{% endif %}) it does the reverse: it promotes the bottom tokens and suppresses the top ones.</p>{% endif %}
<div class="pair">
<table id="value-top"><tr><th class="num">#</th><th>top tokens: {% if signed %}promoted where m &gt; 0, suppressed where m &lt; 0{% else %}promoted{% endif %}</th><th class="num">{{ m.value.shown }}</th></tr>
{% for t in m.value.top %}<tr><td class="num">{{ loop.index }}</td><td>{{ tok(t.token) }}</td><td class="num">{{ value_fmt(t.value) }}</td></tr>{% endfor %}</table>
<table id="value-bottom"><tr><th class="num">#</th><th>bottom tokens: {% if signed %}suppressed where m &gt; 0, promoted where m &lt; 0{% else %}suppressed{% endif %}</th><th class="num">{{ m.value.shown }}</th></tr>
{% for t in m.value.bottom %}<tr><td class="num">{{ loop.index }}</td><td>{{ tok(t.token) }}</td><td class="num">{{ value_fmt(t.value) }}</td></tr>{% endfor %}</table>
</div>
<h2>Activation over a corpus sample</h2>
{% if m.histogram.positions %}<div id="histogram">{{ histogram }}</div>
<p class="note">m of this key at every position of {{ m.histogram.examples }} examples sampled from the run ({{ "{:,}".format(m.histogram.positions) }} positions);
bar heights on a log scale. Active (|m| &gt; tau·s_l, which is m &gt; 0 for ReLU models; docs/definitions.md) at {{ pct(m.stats.activation_frequency, 2) }} of positions. The strongest trigger example (largest |m|) reaches m = {{ fmt(top_coefficient) }}.</p>
{% else %}<p class="muted">No corpus sample.</p>{% endif %}
<h2>Next tokens of the trigger examples</h2>
<p id="next-tokens">{% for t in m.next_tokens %}<span class="chip">{{ tok(t.token) }} ×{{ t.count }}</span>{% endfor %}</p>
{% if m.dead %}<p class="warn" id="never-fired"><strong>This memory never fired.</strong> No position of the indexed corpus makes it active
(|m| &gt; tau·s_l; docs/definitions.md, dead keys): the rows below are only its largest coefficients, none of them active, not trigger examples.
It is left out of the pattern shares (Figure 2).</p>{% endif %}
{% for group in m.triggers %}<h2>{% if m.dead %}None active, {{ group.title }}{% else %}Trigger examples: {{ group.title }}{% endif %}</h2>
<p class="note">{% if group.direction < 0 %}Here m &lt; 0: the memory promotes its value's bottom tokens. {% endif %}Each token shaded by this key's coefficient m at that position ({% if encoder %}the whole example in view{% else %}the prefix ending there{% endif %}; blue positive, red negative; hover for the value).
The trigger position is boxed, the next token underlined.{% if m.window %}
<span id="window-note">A hatched token has no coefficient here (it is not m = 0): this run stores m for {{ m.window[0] }} tokens before each trigger and {{ m.window[1] }} after it, a window that bounds the stored coefficients' size; the tokens beyond it are shown for reading.</span>{% endif %}{% if m.stored_ranks %}
<span id="ranks-note">This run's index is too large to store every example's coefficients: they are stored for the {% if m.stored_ranks == 1 %}strongest example{% else %}{{ m.stored_ranks }} strongest examples{% endif %} of each direction; each example below those shows the trigger position's m alone (the index's), the other tokens hatched.</span>{% endif %}</p>
<table id="{{ 'triggers' if group.direction == 1 else 'triggers-negative' }}" class="triggers"><tr><th class="num">rank</th><th class="barcell">coefficient</th><th>example</th></tr>
{% for e in group.examples %}<tr><td class="num">{{ e.rank + 1 }}</td><td class="barcell"><span class="bar{% if e.coefficient < 0 %} neg{% endif %}" style="width: {{ '%.1f' % e.bar }}px"></span> {{ fmt(e.coefficient) }}</td>
<td class="example">{{ strip(e.tokens) }}{% if e.next_token_id < 0 %} <span class="muted small">⟨end⟩</span>{% endif %}</td></tr>{% endfor %}
</table>{% endfor %}
</div>""",

"memory.html": """{% extends "base.html" %}{% block title %}memory {{ ln(m.layer) }}:{{ m.key }}{% endblock %}
{% block main %}{% include "memory_fragment.html" %}
{% with action = root ~ "/memory/" ~ ln(m.layer) ~ "/" ~ m.key ~ "/annotate" %}{% include "annotate.html" %}{% endwith %}
<p class="small muted">Labels are stored in <code>annotations/labels.parquet</code> of the run and feed the human side of the patterns experiment.</p>
{% endblock %}""",

"annotate.html": """<h2>Annotate</h2>
<form method="post" action="{{ action }}" id="annotate">
<p>{% for name in labels %}<label><input type="radio" name="label" value="{{ name }}"{% if loop.first %} required{% endif %}> {{ name }}</label> {% endfor %}</p>
<p><input type="text" name="description" placeholder="describe the pattern (e.g. ends with 'part of')" size="60" maxlength="2000"></p>
<p><input type="text" name="annotator" placeholder="your name" size="20" maxlength="100"> <button type="submit">Save label</button></p>
</form>""",

"latent_fragment.html": """<div class="ffkv-memory ffkv-latent">{% if standalone %}<style>{{ css }}</style>{% endif %}
<h1>Latent {{ l.address }} <span class="muted small">{{ l.kind }} at layer {{ ln(l.layer) }} of {{ n_layers }}, latent {{ l.key }} of {{ "{:,}".format(l.n_latents) }}</span></h1>
<p id="latent-nav">{% if l.key > 0 %}<a href="{{ root }}/memory/{{ l.name }}:{{ l.key - 1 }}">← latent {{ l.key - 1 }}</a> · {% endif %}<a href="{{ root }}/layer/{{ l.name }}" id="latent-layer-link">{{ l.name }}'s latents</a>{% if l.key + 1 < l.n_latents %} · <a href="{{ root }}/memory/{{ l.name }}:{{ l.key + 1 }}">latent {{ l.key + 1 }} →</a>{% endif %}
· <a href="{{ root }}/layer/{{ ln(l.layer) }}" id="neurons-link">layer {{ ln(l.layer) }}'s neurons</a>
· <a href="{{ root }}/memory/{{ l.address }}.json?projection={{ l.projection }}&amp;shown={{ l.value.shown }}" id="json-link">JSON</a></p>
<p class="note" id="latent-note">A latent of the run's sparse dictionary ({{ l.kind }}; docs/definitions.md) is a memory of its own: its key is encoder row e_j, its coefficient the
dictionary's activation a_j (never negative), its value decoder row d_j, read here as a neuron's value is read. Latents are written {{ l.name }}:LATENT; neurons LAYER:KEY.</p>
<h2>Pattern</h2>
<div id="pattern">{% if l.auto %}<p><strong>Automatic (ffkv analyze):</strong> <span class="label-{{ l.auto.label }}" id="auto-label">{{ l.auto.label }}</span>
<span class="small muted">shallow score {{ pct(l.auto.shallow_score) }}; semantic z {{ fmt(l.auto.semantic_z, 2) }} (the neurons' rules, docs/definitions.md)</span></p>
{% else %}<p class="muted" id="no-auto-label">No automatic label yet: <code>ffkv analyze --only patterns</code> labels the latents beside the neurons.</p>{% endif %}
<p><strong>Surface:</strong> {{ pct(l.surface.share) }} of the top prefixes end in {{ tok(l.surface.token) }}.</p>
{% if l.census %}<p id="census-badge"><strong>Census:</strong> <span class="chip label-{{ l.census.census_class }}">{{ l.census.census_class }}</span>
<span class="chip">value: {{ l.census.census_value_type }}</span>{% if l.census.census_eraser %}<span class="chip">eraser</span>{% endif %}
{% if l.census.census_rule %}<span class="small">best token rule for its strong activations over the census's corpus sample (not its top trigger examples, which the pattern above reads): {{ l.census.census_rule }} (F1 {{ pct(l.census.census_rule_f1) }})</span>{% endif %}
<span class="small muted">position explains {{ pct(l.census.census_position_eta2) }} of a's variance</span></p>{% endif %}
{% for h in l.human %}<p class="human-label"><strong>Human ({{ h.annotator }}, {{ h.time }}):</strong> <span class="label-{{ h.label }}">{{ h.label }}</span>{% if h.description %} — <span class="human-description">{{ h.description }}</span>{% endif %}</p>{% endfor %}</div>
{% with explanations = l.explanations, explain_command = "ffkv explain --latents" %}{% include "explanations.html" %}{% endwith %}
<h2>Value</h2>
{% if l.dictionary_error %}<p class="warn" id="dictionary-error">The dictionary could not be read again ({{ l.dictionary_error }}): the value's top tokens below are those the lookups stored (identity projection).</p>
{% else %}<p class="switch" id="projection-switch">Read the value {% for p, s, label in projections %}{% if p == l.projection and s == l.value.shown %}<span class="on">{{ label }}</span>{% else %}<a href="?projection={{ p }}&amp;shown={{ s }}#projection-switch">{{ label }}</a>{% endif %}{% endfor %}</p>{% endif %}
<p class="note" id="value-numbers">{{ projection_note }} Under this projection the top token has {% if l.value.top_value is none %}p = {{ pct(l.stats.confidence) }} (identity){% elif l.value.shown == "p" %}p = {{ pct(l.value.top_value) }} (uniform: {{ pct(uniform) }}){% else %}logit {{ value_fmt(l.value.top_value) }}{% endif %};
the top-1 trigger's {{ target_name }} ranks {% if l.value.target_rank is not none %}{{ l.value.target_rank }}{% if l.value.target_rank == 1 %}: it <strong>is</strong> the value's top token{% endif %}{% else %}— (none){% endif %}; ‖d‖ = {{ fmt(l.stats.value_norm) }}.</p>
{% if l.value.uniform %}<p class="warning" id="uniform-note">Under this projection the distribution is indistinguishable from uniform: its entropy is {{ pct(l.value.entropy_share, 2) }} of the largest a distribution over the vocabulary can have (uniform: 100%), and its top token has {{ "%.2f"|format(l.value.top_p / uniform) }}× the uniform probability: nothing in it stands out (docs/definitions.md, "Projections"). Read it under another projection.</p>{% endif %}
<div class="pair">
<table id="value-top"><tr><th class="num">#</th><th>top tokens: promoted</th><th class="num">{{ l.value.shown }}</th></tr>
{% for t in l.value.top %}<tr><td class="num">{{ loop.index }}</td><td>{{ tok(t.token) }}</td><td class="num">{{ value_fmt(t.value) }}</td></tr>{% endfor %}</table>
{% if l.value.bottom %}<table id="value-bottom"><tr><th class="num">#</th><th>bottom tokens: suppressed</th><th class="num">{{ l.value.shown }}</th></tr>
{% for t in l.value.bottom %}<tr><td class="num">{{ loop.index }}</td><td>{{ tok(t.token) }}</td><td class="num">{{ value_fmt(t.value) }}</td></tr>{% endfor %}</table>{% endif %}
</div>
<h2>Activation over a corpus sample</h2>
{% if l.histogram.positions %}<div id="histogram">{{ histogram }}</div>
<p class="note">a of this latent at every position of {{ l.histogram.examples }} examples sampled from the run ({{ "{:,}".format(l.histogram.positions) }} positions); bar heights on a log scale.
Active (a &gt; 0) at {{ pct(l.stats.activation_frequency, 2) }} of positions. The strongest trigger example reaches a = {{ fmt(top_coefficient) }}.</p>
{% else %}<p class="muted">No corpus sample.</p>{% endif %}
<h2>Next tokens of the trigger examples</h2>
<p id="next-tokens">{% for t in l.next_tokens %}<span class="chip">{{ tok(t.token) }} ×{{ t.count }}</span>{% endfor %}</p>
{% if l.dead %}<p class="warn" id="never-fired"><strong>This latent never fired</strong> over the indexed corpus: it has no trigger examples.</p>{% else %}
<h2>Trigger examples: largest activations</h2>
<p class="note">Each token shaded by this latent's activation a at that position ({% if encoder %}the whole example in view{% else %}the prefix ending there{% endif %}; hover for the value). The trigger position is boxed, the next token underlined.{% if not l.shaded and l.examples %} <span id="not-stored">The lookups stored no per-token activations for this run (too many trigger rows), and without the run's model and dictionary the explorer cannot compute them: only the trigger position's is shown.</span>{% endif %}{% if l.window %}
<span id="window-note">A hatched token has no activation here (it is not a = 0): this run stores a for {{ l.window[0] }} tokens before each trigger and {{ l.window[1] }} after it; the tokens beyond it are shown for reading.</span>{% endif %}{% if l.stored_ranks %}
<span id="ranks-note">This run's index is too large to store every example's activations: they are stored for its {% if l.stored_ranks == 1 %}strongest example{% else %}{{ l.stored_ranks }} strongest examples{% endif %}; each example below those shows the trigger position's a alone (the index's), the other tokens hatched.</span>{% endif %}</p>
<table id="triggers" class="triggers"><tr><th class="num">rank</th><th class="barcell">activation</th><th>example</th></tr>
{% for e in l.examples %}<tr><td class="num">{{ e.rank + 1 }}</td><td class="barcell"><span class="bar" style="width: {{ '%.1f' % e.bar }}px"></span> {{ fmt(e.coefficient) }}</td>
<td class="example">{{ strip(e.tokens) }}{% if e.next_token_id < 0 %} <span class="muted small">⟨end⟩</span>{% endif %}</td></tr>{% endfor %}
</table>{% endif %}
</div>""",

"latent.html": """{% extends "base.html" %}{% block title %}latent {{ l.address }}{% endblock %}
{% block main %}{% include "latent_fragment.html" %}
{% with action = root ~ "/memory/" ~ l.address ~ "/annotate" %}{% include "annotate.html" %}{% endwith %}
<p class="small muted">A latent's labels are stored in <code>annotations/latent_labels.parquet</code> of the run, beside the neurons' (<code>annotations/labels.parquet</code>), with the same columns (<code>key</code>: the latent).</p>
{% endblock %}""",

"latent_layer.html": """{% extends "base.html" %}{% block title %}latents {{ dictionary }}{% endblock %}
{% block main %}<h1>Latents {{ dictionary }} <span class="muted small">{{ kind }} at layer {{ ln(layer) }} of {{ n_layers }}</span></h1>
<p>{% for other in dictionaries %}{% if not loop.first %} · {% endif %}{% if other.name == dictionary %}<strong>{{ other.name }}</strong>{% else %}<a href="{{ root }}/layer/{{ other.name }}?sort={{ sort|urlencode }}&order={{ order }}">{{ other.name }}</a>{% endif %}{% endfor %}
· <a href="{{ root }}/layer/{{ ln(layer) }}" id="neurons-link">layer {{ ln(layer) }}'s neurons</a></p>
<p class="note">{{ "{:,}".format(n_keys) }} latents, sorted by {{ sort }} ({{ "descending" if order == "desc" else "ascending" }}); rows {{ first }}–{{ last }}, page {{ page }} of {{ n_pages }}. Click a column's name to sort by it.
Value: decoder row d_j's top tokens and agreement under the identity projection, as the neurons' values; active: share of positions of a corpus sample where a &gt; 0; largest a: its rank-1 trigger example;
common last token: the last token most of its trigger prefixes share, and that share. A latent without trigger examples never fired over the indexed corpus (dead).{% if explained %}
Explanation: the latent's own (<code>ffkv explain --latents</code>), and its score, the simulation score of <code>ffkv score</code>; docs/explain.md.{% endif %}</p>
<div class="scroll long"><table id="latents"><tr>{% for c in columns %}<th{% if c.num %} class="num"{% endif %}><a href="{{ root }}/layer/{{ dictionary }}?sort={{ c.sort|urlencode }}&order={{ 'asc' if c.sort == sort and order == 'desc' else 'desc' }}"{% if c.sort == sort %} class="on"{% endif %}>{{ c.title }}{% if c.sort == sort %} {{ "▼" if order == "desc" else "▲" }}{% endif %}</a></th>{% endfor %}</tr>
{% for row in rows %}<tr>{% for cell in row %}<td class="{{ cell.cls }}">{% if cell.href %}<a href="{{ root }}{{ cell.href }}">{{ cell.text }}</a>{% elif cell.tokens %}{% for t in cell.tokens %}{{ tok(t) }} {% endfor %}{% elif cell.token is not none %}{{ tok(cell.token) }}{% else %}{{ cell.text }}{% endif %}</td>{% endfor %}</tr>{% endfor %}
</table></div>
<form method="get" action="{{ root }}/layer/{{ dictionary }}" id="pager"><p>{% if page > 1 %}<a href="{{ root }}/layer/{{ dictionary }}?sort={{ sort|urlencode }}&order={{ order }}&page=1" id="first-page">« first</a>
<a href="{{ root }}/layer/{{ dictionary }}?sort={{ sort|urlencode }}&order={{ order }}&page={{ page - 1 }}" id="previous-page">← previous</a>{% endif %}
{% if page < n_pages %} <a href="{{ root }}/layer/{{ dictionary }}?sort={{ sort|urlencode }}&order={{ order }}&page={{ page + 1 }}" id="next-page">next →</a>
<a href="{{ root }}/layer/{{ dictionary }}?sort={{ sort|urlencode }}&order={{ order }}&page={{ n_pages }}" id="last-page">last »</a>{% endif %}
{% if n_pages > 2 %}<input type="hidden" name="sort" value="{{ sort }}"><input type="hidden" name="order" value="{{ order }}">
<label>page <input type="number" name="page" min="1" max="{{ n_pages }}" value="{{ page }}" style="width:5em"></label> of {{ "{:,}".format(n_pages) }} <button type="submit">go</button>{% endif %}</p></form>
{% endblock %}""",

"search.html": """{% extends "base.html" %}{% block title %}search{% endblock %}
{% block main %}<h1>Search</h1>
<form method="get" action="{{ root }}/search" id="token-search"><p>Which memories promote the token
<input type="text" name="token" value="{{ token or '' }}" placeholder="a token, or #ID"> <button type="submit">Find memories</button></p></form>
<form method="get" action="{{ root }}/search" id="text-search"><p>Trigger examples containing{% if any_explained %}, and memories whose explanation holds every word of{% endif %}
<input type="text" name="q" value="{{ q or '' }}" placeholder="text, or an address: 3:17{% if has_latents %}, t4:42{% endif %}" size="40"> <button type="submit">Search text</button></p></form>
{% if promoting %}<h2>Memories whose value ranks {{ tok(promoting.token) }} highest</h2>
<p class="note" id="promoting-count"><strong>{{ "{:,}".format(promoting.n_ranked) }}</strong> memor{{ "ies rank" if promoting.n_ranked != 1 else "y ranks" }} {{ tok(promoting.token) }} among their value's top {{ promoting.top_tokens }} tokens, {{ "{:,}".format(promoting.n_top) }} as the top one{% if promoting.n_pages > 1 %}; page {{ promoting.page }} of {{ promoting.n_pages }}, {{ limit }} a page{% endif %}.
Rank within each value's distribution (identity projection, as in the paper; exact within its top {{ promoting.top_tokens }}; past that, on the last page, the keys that give the token most probability, rank "&gt;{{ promoting.top_tokens }}").</p>
{{ pages_nav(root ~ "/search?token=" ~ token|urlencode, promoting.page, promoting.n_pages, "promoting-pages") }}
<table id="promoting"><tr><th>memory</th><th class="num">rank</th><th class="num">p</th><th>value's top token</th></tr>
{% for r in promoting.results %}<tr><td><a href="{{ root }}/memory/{{ ln(r.layer) }}/{{ r.key }}">{{ ln(r.layer) }}:{{ r.key }}</a></td><td class="num">{% if r.rank is not none %}{{ r.rank + 1 }}{% else %}&gt;{{ promoting.top_tokens }}{% endif %}</td><td class="num">{{ value_fmt(r.prob) }}</td><td>{{ tok(r.top_token) }}</td></tr>{% endfor %}
</table>{% endif %}
{% if latents_promoting is not none %}<h2>Latents whose value ranks {{ tok(promoting.token) }} highest</h2>
<p class="note">Latents of the run's sparse dictionary (written tLAYER:LATENT), their decoder row read as a value (identity projection; exact within its top {{ promoting.top_tokens }}).</p>
{% if not latents_promoting %}<p class="muted" id="no-latents-promoting">No latent ranks this token among its value's top {{ promoting.top_tokens }}.</p>{% else %}
<table id="latents-promoting"><tr><th>latent</th><th class="num">rank</th><th class="num">p</th><th>value's top token</th></tr>
{% for r in latents_promoting %}<tr><td><a href="{{ root }}/memory/{{ r.address }}">{{ r.address }}</a> <span class="chip">latent</span></td><td class="num">{{ r.rank + 1 }}</td><td class="num">{{ value_fmt(r.prob) }}</td><td>{{ tok(r.top_token) }}</td></tr>{% endfor %}
</table>{% endif %}{% endif %}
{% if explained is not none and any_explained %}<h2>Memories whose explanation holds “{{ q }}”</h2>
{% if not explained %}<p class="muted" id="no-explained">No explanation holds every word of this text.</p>{% else %}
<p class="note">{{ explained|length }} memor{{ "ies" if explained|length != 1 else "y" }}{% if explained|length >= limit %} (the first {{ limit }}){% endif %}, best simulation score first (<code>ffkv explain</code>, <code>ffkv score</code>; LAYER:KEY, layers from 1{% if has_latents %}; a latent of the run's dictionary tLAYER:LATENT, <code>ffkv explain --latents</code>{% endif %}).</p>
<table id="explained"><tr><th>memory</th><th>explanation</th><th class="num">score</th></tr>
{% for x in explained %}<tr><td>{% if x.address %}<a href="{{ root }}/memory/{{ x.address }}">{{ x.address }}</a> <span class="chip">latent</span>{% else %}<a href="{{ root }}/memory/{{ ln(x.layer) }}/{{ x.key }}">{{ ln(x.layer) }}:{{ x.key }}</a>{% endif %}</td><td>{% if x.direction < 0 %}<span class="chip">m &lt; 0</span> {% endif %}{{ x.explanation }}</td><td class="num">{% if x.score is not none %}{{ "%.2f"|format(x.score) }}{% else %}<span class="muted">not scored</span>{% endif %}</td></tr>{% endfor %}</table>{% endif %}{% endif %}
{% if named %}<p id="named-memory">“{{ q }}” is the address of {{ named.what }} <a href="{{ root }}{{ named.href }}">{{ named.address }}</a> (its value's top token {{ tok(named.top_token) }}).</p>{% endif %}
{% if hits is not none %}<h2>Trigger examples containing “{{ q }}”</h2>
{% if not hits %}<p class="muted" id="no-hits">No trigger example contains this text.</p>{% else %}
<p class="note" id="hits-count"><strong>{{ "{:,}".format(n_hits) }}</strong> trigger example{{ "s" if n_hits != 1 }} hold{{ "s" if n_hits == 1 }} it{% if hit_pages > 1 %}; page {{ page }} of {{ hit_pages }}, {{ limit }} a page{% endif %}. Beside each, the memories (LAYER:KEY, layers from 1) it is a trigger example of, strongest |m| first: the top {{ shown }}, then “more”{% if has_latents %}; below them, the latents of the run's dictionary (tLAYER:LATENT) it is a trigger example of, largest activation a first{% endif %}.</p>
{{ pages_nav(root ~ "/search?q=" ~ q|urlencode, page, hit_pages, "hits-pages") }}{% endif %}
<table id="hits">{% for h in hits %}<tr><td class="example">{% for part, hit in h.parts %}{% if hit %}<mark class="hit">{{ part }}</mark>{% else %}{{ part }}{% endif %}{% endfor %}</td>
<td>{% for mem in h.memories[:shown] %}{{ chip(mem, root) }}{% endfor %}
{% if h.memories|length > shown %}<details><summary>{{ h.n_memories - shown }} more</summary>{% for mem in h.memories[shown:] %}{{ chip(mem, root) }}{% endfor %}{% if h.n_memories > h.memories|length %}<span class="muted small">… and {{ h.n_memories - h.memories|length }} weaker</span>{% endif %}</details>{% endif %}
{% if h.latents %}<div class="latent-chips"><span class="small muted">latents:</span> {% for mem in h.latents[:shown] %}{{ chip(mem, root) }}{% endfor %}
{% if h.latents|length > shown %}<details><summary>{{ h.n_latents - shown }} more latents</summary>{% for mem in h.latents[shown:] %}{{ chip(mem, root) }}{% endfor %}{% if h.n_latents > h.latents|length %}<span class="muted small">… and {{ h.n_latents - h.latents|length }} weaker</span>{% endif %}</details>{% endif %}</div>{% endif %}</td></tr>{% endfor %}</table>{% endif %}
{% endblock %}""",

"concepts.html": """{% extends "base.html" %}{% block title %}concepts{% endblock %}
{% block main %}<h1>Concepts{% if layer == "all" %} · all layers{% else %} · layer {{ layer }}{% endif %}</h1>
<form method="get" action="{{ root }}/concepts" id="concepts-layer"><p>Layer
<select name="layer">{% for i in range(n_layers) %}<option value="{{ ln(i) }}"{% if layer == ln(i) %} selected{% endif %}>{{ ln(i) }}</option>{% endfor %}{% if all_ok %}<option value="all"{% if layer == "all" %} selected{% endif %}>all layers</option>{% endif %}</select>
<button type="submit">Cluster</button></p></form>
<p class="note" id="method">Each value's top {{ top }} tokens of v·Eᵀ (identity projection, as in the paper); two values are linked
when they share at least {{ min_shared }} of them, and a concept is a connected group of at least two values (single linkage), named
by the tokens most of its values share. {{ n_concepts }} concept{{ "s" if n_concepts != 1 }}{% if n_concepts > concepts|length %}, the largest {{ concepts|length }} shown{% endif %}.
Memories are LAYER:KEY, layers from 1: promote a concept with <code class="cmd">ffkv intervene {{ run_path }} --set L:K=VALUE ...</code>, suppress it with <code class="cmd">--off L:K ...</code>.</p>
{% if not concepts %}<p class="muted" id="no-concepts">No two values of this selection share {{ min_shared }} top tokens.</p>{% endif %}
<table id="concepts"><tr><th class="num">concept</th><th class="num">values</th><th>shared top tokens</th><th>memories</th><th>suppress it</th></tr>
{% for c in concepts %}<tr><td class="num">{{ c.concept }}</td><td class="num">{{ c.size }}</td><td>{% for t in c.tokens %}{{ tok(t) }} {% endfor %}</td>
<td>{% for m in c.memories %}<a class="chip" href="{{ root }}/memory/{{ ln(m.layer) }}/{{ m.key }}" title="{{ m.top|join(' ') }}">{{ ln(m.layer) }}:{{ m.key }}</a>{% endfor %}</td>
<td><code class="small">ffkv intervene {{ run_path }}{% for m in c.memories %} <span class="cmd">--off {{ ln(m.layer) }}:{{ m.key }}</span>{% endfor %}</code></td></tr>{% endfor %}</table>
{% endblock %}""",

"trace_fragment.html": """<div class="ffkv-trace">{% if standalone %}<style>{{ css }}</style>{% endif %}
{% if interactive %}<p class="note">Pick a position: the table reads the model at that token.</p>
<div class="strip" id="token-strip">{% for s in t.strip %}<button type="submit" name="position" value="{{ s.index }}"{% if s.index == t.position %} class="on"{% endif %} title="token {{ s.index + 1 }}">{{ show(s.text) }}</button>{% endfor %}</div>
{% else %}<p class="tokens" id="token-strip">{% for s in t.strip %}<span class="t{% if s.index == t.position %} trig{% endif %}">{{ show(s.text) }}</span>{% endfor %}</p>{% endif %}
<p class="prediction" id="prediction">At {{ tok(t.token) }} (token {{ t.position + 1 }} of {{ t.n_tokens }}) the model predicts {{ tok(t.final[0].token) }} {{ pct(t.final[0].prob, 1) }}{% if compare %}; with the interventions {{ tok(t.final[0].new_token) }} {{ pct(t.final[0].new_prob, 1) }}{% endif %}.</p>
<p class="note">Per layer: the top token of the residual before the FF layer (resid_mid) and after it (resid_post), read through
{{ t.lens_text }}, and of the FF output itself (identity). Memories: the largest contributions m·(v·E[{{ t.target }}]) to the token
{{ tok(t.target) }} (the model's prediction unless another token is given); red chips push against it. LAYER:KEY, layers counted from 1.{% if has_latents %}
Where the run's sparse dictionary covers a layer, its active latents that push the token most are listed below the neurons (a_j·(d_j·E[t]); tLAYER:LATENT). Edit them as the neurons: the layer's output then becomes the dictionary's reconstruction with the edit plus its error term, FF(x) + Σ_j (a′_j − a_j)·d_j, so an edit that changes nothing leaves the model as it is.{% endif %}
{% if compare %}Each cell: <strong>original → with interventions</strong>; highlighted where the top token changed or its probability moved by at least {{ threshold_pp }} percentage points.{% endif %}</p>
<div class="scroll"><table id="predictions"><tr><th class="num">layer</th><th>before FF</th><th>FF output</th><th>after FF</th><th>memories that push {{ tok(t.target) }} most</th></tr>
{% for row in t.rows %}<tr data-layer="{{ ln(row.layer) }}"><td class="num"><a href="{{ root }}/layer/{{ ln(row.layer) }}">{{ ln(row.layer) }}</a></td>
{% for part in ("before", "ff", "after") %}<td class="pred pred-{{ part }}{% if compare and row[part].changed %} changed{% endif %}">{{ tok(row[part].token) }} <span class="small muted">{{ pct(row[part].prob, 1) }}</span>{% if compare %} → {{ tok(row[part].new_token) }} <span class="small muted">{{ pct(row[part].new_prob, 1) }}</span>{% endif %}{% if row[part].target_prob is not none %}<span class="target-p small" title="the probability of the target token under the same reading">{{ tok(t.target) }} {{ pct(row[part].target_prob, 1) }}{% if compare %} → {{ pct(row[part].new_target_prob, 1) }}{% endif %}</span>{% endif %}</td>{% endfor %}
<td class="mems">{% for mem in row.memories %}<span class="chip{% if mem.contribution < 0 %} neg{% endif %}"><a href="{{ root }}/memory/{{ ln(row.layer) }}/{{ mem.key }}">{{ ln(row.layer) }}:{{ mem.key }}</a> <span class="small muted">{{ "%+.2f"|format(mem.contribution) }} (m={{ fmt(mem.coefficient, 2) }}{% if mem.edited_coefficient is not none %}<strong class="edited-m" title="as edited"> → {{ fmt(mem.edited_coefficient, 2) }}</strong>{% endif %}) → {{ tok(mem.top_token) }}</span>
{% if interactive %}<label title="switch this memory off"><input type="checkbox" name="off" value="{{ ln(row.layer) }}:{{ mem.key }}"{% if mem.edit_op == "off" %} checked{% endif %}>off</label>
<input type="number" step="any" name="scale:{{ ln(row.layer) }}:{{ mem.key }}" value="{% if mem.edit_op == "scale" %}{{ mem.edit_value }}{% endif %}" placeholder="×1" title="scale: multiply m by this factor">
<input type="number" step="any" name="set:{{ ln(row.layer) }}:{{ mem.key }}" value="{% if mem.edit_op == "set" %}{{ mem.edit_value }}{% endif %}" placeholder="=m" title="set: m takes this value at every position">{% elif mem.edit_label %}<strong>{{ mem.edit_label }}</strong>{% endif %}</span>{% endfor %}
{% if row.latents %}<div class="trace-latents"><span class="small muted">latents:</span> {% for x in row.latents %}<span class="chip latent{% if x.contribution < 0 %} neg{% endif %}"><a href="{{ root }}/memory/{{ x.address }}">{{ x.address }}</a> <span class="small muted">{{ "%+.2f"|format(x.contribution) }} (a={{ fmt(x.coefficient, 2) }}{% if x.edited_coefficient is not none %}<strong class="edited-m" title="as edited"> → {{ fmt(x.edited_coefficient, 2) }}</strong>{% endif %}) → {{ tok(x.top_token) }}</span>
{% if interactive %}<label title="switch this latent off"><input type="checkbox" name="off" value="{{ x.address }}"{% if x.edit_op == "off" %} checked{% endif %}>off</label>
<input type="number" step="any" name="scale:{{ x.address }}" value="{% if x.edit_op == "scale" %}{{ x.edit_value }}{% endif %}" placeholder="×1" title="scale: multiply a by this factor">
<input type="number" step="any" name="set:{{ x.address }}" value="{% if x.edit_op == "set" %}{{ x.edit_value }}{% endif %}" placeholder="=a" title="set: a takes this value at every position">{% elif x.edit_label %}<strong>{{ x.edit_label }}</strong>{% endif %}</span>{% endfor %}</div>{% endif %}</td></tr>{% endfor %}
</table></div>
<h3>Model's prediction</h3>
<table id="final"><tr><th class="num">#</th><th>original</th>{% if compare %}<th>with interventions</th>{% endif %}</tr>
{% for row in t.final %}<tr><td class="num">{{ loop.index }}</td><td>{{ tok(row.token) }} <span class="small muted">{{ pct(row.prob, 1) }}</span></td>{% if compare %}<td{% if row.changed %} class="changed"{% endif %}>{{ tok(row.new_token) }} <span class="small muted">{{ pct(row.new_prob, 1) }}</span></td>{% endif %}</tr>{% endfor %}
</table>
{% if generation %}<h3>Generated</h3>
<table id="generation"><tr><th></th><th>prompt + {{ generation.n }} greedy tokens</th></tr>
<tr><td>original</td><td class="gen" id="generated-original">{{ generation.prompt }}<span class="new">{{ generation.original }}</span></td></tr>
{% if generation.edited is not none %}<tr><td>with interventions</td><td class="gen" id="generated-edited">{{ generation.prompt }}<span class="new">{{ generation.same }}</span><span class="diff">{{ generation.edited_rest }}</span></td></tr>
<tr><td></td><td class="note">{% if generation.differs %}The continuations part after {{ generation.common }} token{{ "s" if generation.common != 1 }} (highlighted from there).{% else %}The interventions leave these {{ generation.n }} tokens unchanged.{% endif %}</td></tr>{% endif %}
</table>{% endif %}
</div>""",

"trace.html": """{% extends "base.html" %}{% block title %}trace{% endblock %}
{% block main %}<h1>Trace a prompt</h1>
<form method="get" action="{{ root }}/trace" id="trace-form">
<p><textarea name="prompt" rows="3" maxlength="{{ max_chars }}" placeholder="type a prompt">{{ prompt or '' }}</textarea></p>
<p><button type="submit" name="action" value="trace" id="run-trace">Trace</button>
{% if lenses %}<label>residual read by <select name="lens" id="lens">{% for value, label in lenses %}<option value="{{ value }}"{% if t and value == t.lens %} selected{% endif %}>{{ label }}</option>{% endfor %}</select></label>{% endif %}
{% if t %}<button type="submit" name="action" value="intervene" id="apply">Apply interventions</button>
{% if can_generate %}<label>generate <input type="number" name="n_generate" min="1" max="{{ max_new }}" value="{{ n_generate }}" style="width:4em"> tokens</label>
<button type="submit" name="action" value="generate" id="generate">Generate</button>{% endif %}
<label>memories pushing the token <input type="text" name="target" value="{{ t.target_text }}" size="10" placeholder="prediction" title="a token, or #ID; empty: the model's prediction"></label>
<a href="{{ root }}/trace?prompt={{ prompt|urlencode }}">reset</a>{% endif %}</p>
{% if t %}<input type="hidden" name="current_position" value="{{ t.position }}">
<p class="note">Switch memories off, scale them or set their coefficient (applied at every position), then apply: the predictions with the interventions appear beside the original ones{% if can_generate %}, and Generate continues the prompt with and without them{% endif %}.</p>
{% include "trace_fragment.html" %}{% endif %}
</form>{% endblock %}""",
}
