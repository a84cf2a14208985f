"""The explorer's page templates (Jinja2, autoescaped: every user or corpus text is escaped).

Kept as strings in a module so that they install with the package, like any code.
The `*_fragment` templates are also what notebooks show (`_repr_html_`).
"""

TEMPLATES = {
"base.html": """<!doctype html>
<html lang="en"><head><meta charset="utf-8"><meta name="viewport" content="width=device-width, initial-scale=1">
<link rel="icon" href="data:,"><title>{% block title %}ffkv explorer{% endblock %} · {{ run_name }}</title>
<style>{{ css }}</style></head>
<body><header class="top"><a href="{{ root }}/">ffkv · {{ run_name }}</a><a href="{{ root }}/search">Search</a>
<a href="{{ root }}/trace">Trace</a>{% if has_report %}<a href="{{ root }}/files/report.html">Report</a>{% endif %}</header>
<main>{% block main %}{% endblock %}</main></body></html>""",

"error.html": """{% extends "base.html" %}{% block title %}{{ status }}{% endblock %}
{% block main %}<h1>{{ status }} · {{ reason }}</h1><p class="error" id="error-message">{{ message }}</p>
<p><a href="{{ root }}/">Back to the overview</a></p>{% endblock %}""",

"overview.html": """{% extends "base.html" %}{% block title %}overview{% endblock %}
{% block main %}<h1>Run {{ run_name }}</h1>
<dl class="run">{% for k, v in run_rows %}<dt>{{ k }}</dt><dd>{{ v }}</dd>{% endfor %}</dl>
<h2>Layers</h2>
<p class="muted small">Values projected with the identity (as in the paper); agreement: the value's top token equals
the next token of the key's top-1 trigger example; activation frequency: share of positions of a corpus sample with m&gt;0;
shallow share: share of the top trigger prefixes ending in the key's most common last token.</p>
<div class="scroll"><table id="layers"><tr>{% for c in summary_columns %}<th class="num">{{ c }}</th>{% endfor %}</tr>
{% for row in summary_rows %}<tr>{% for c in summary_columns %}<td class="num">{% if c == "layer" %}<a href="{{ root }}/layer/{{ row[c] }}">layer {{ row[c] }}</a>{% else %}{{ fmt(row[c]) }}{% endif %}</td>{% endfor %}</tr>{% endfor %}
</table></div>
<h2>Figures</h2>
{% if not figures %}<p class="muted" id="no-figures">No figures yet: run <code>ffkv analyze</code> on this run.</p>{% endif %}
{% for f in figures %}<section class="figure-block"><figure><img src="{{ root }}/files/{{ f.path }}" alt="{{ f.name }}" loading="lazy"><figcaption class="small muted">{{ f.name }}</figcaption></figure>
<div>{% if f.finding %}<div class="finding"><strong>Paper{% if f.paper_figure %} ({{ f.paper_figure }}){% endif %}:</strong> {{ f.finding }}</div>{% endif %}</div></section>{% endfor %}
{% endblock %}""",

"layer.html": """{% extends "base.html" %}{% block title %}layer {{ layer }}{% endblock %}
{% block main %}<h1>Layer {{ layer }}</h1>
<p>{% if layer > 0 %}<a href="{{ root }}/layer/{{ layer - 1 }}?sort={{ sort }}&order={{ order }}">← layer {{ layer - 1 }}</a>{% endif %}
{% if layer + 1 < n_layers %} <a href="{{ root }}/layer/{{ layer + 1 }}?sort={{ sort }}&order={{ order }}">layer {{ layer + 1 }} →</a>{% endif %}</p>
<form method="get" action="{{ root }}/layer/{{ layer }}">Sort by <select name="sort" id="sort">{% for s in sorts %}<option value="{{ s }}"{% if s == sort %} selected{% endif %}>{{ s }}</option>{% endfor %}</select>
<select name="order"><option value="desc"{% if order == "desc" %} selected{% endif %}>descending</option><option value="asc"{% if order == "asc" %} selected{% endif %}>ascending</option></select>
<button type="submit">Sort</button></form>
<p class="muted small">{{ n_keys }} keys, sorted by {{ sort }} ({{ order }}); showing {{ first }}–{{ last }}.</p>
<div class="scroll"><table id="keys"><tr>{% for c in columns %}<th>{{ c }}</th>{% endfor %}</tr>
{% for row in rows %}<tr>{% for c in columns %}<td{% if row[c] is number %} class="num"{% endif %}>{% if c == "key" %}<a href="{{ root }}/memory/{{ layer }}/{{ row[c] }}">{{ row[c] }}</a>{% elif c in token_columns %}{{ tok(row[c]) }}{% elif c in percent_columns %}{{ pct(row[c]) }}{% else %}{{ fmt(row[c]) }}{% endif %}</td>{% endfor %}</tr>{% endfor %}
</table></div>
<p>{% if page > 0 %}<a href="{{ root }}/layer/{{ layer }}?sort={{ sort }}&order={{ order }}&page={{ page - 1 }}">← previous</a>{% endif %}
{% if last < n_keys %} <a href="{{ root }}/layer/{{ layer }}?sort={{ sort }}&order={{ order }}&page={{ page + 1 }}" id="next-page">next →</a>{% endif %}</p>
{% endblock %}""",

"memory_fragment.html": """<div class="ffkv-memory">{% if standalone %}<style>{{ css }}</style>{% endif %}
<h1>Memory {{ m.layer }}:{{ m.key }}</h1>
<p>{% if m.key > 0 %}<a href="{{ root }}/memory/{{ m.layer }}/{{ m.key - 1 }}">← key {{ m.key - 1 }}</a> · {% endif %}<a href="{{ root }}/layer/{{ m.layer }}">layer {{ m.layer }}</a>{% if m.key + 1 < d_m %} · <a href="{{ root }}/memory/{{ m.layer }}/{{ m.key + 1 }}">key {{ m.key + 1 }} →</a>{% endif %}</p>
<h2>Pattern</h2>
<div id="pattern">
{% if m.auto %}<p><strong>Automatic (ffkv analyze):</strong> {% if m.auto.label %}<span class="label-{{ m.auto.label }}" id="auto-label">{{ m.auto.label }}</span>{% endif %}
{% if m.auto.description %} — {{ m.auto.description }}{% endif %}
{% for k, v in m.auto.items() if k not in ("label", "description") %}<span class="small muted"> · {{ k }} {{ fmt(v) }}</span>{% endfor %}</p>{% endif %}
<p><strong>Surface:</strong> {{ pct(m.surface.share) }} of the top prefixes end in {{ tok(m.surface.token) }}.</p>
{% for h in m.human %}<p class="human-label"><strong>Human ({{ h.annotator }}, {{ h.time }}):</strong> <span class="label-{{ h.label }}">{{ h.label }}</span>{% if h.description %} — <span class="human-description">{{ h.description }}</span>{% endif %}</p>{% endfor %}
</div>
<h2>Value: top tokens</h2>
<p class="small muted">p = softmax(v·Eᵀ) (identity normalization). Confidence {{ pct(m.stats.confidence) }};
top-1 trigger's next token ranks {% if m.stats.next_token_rank >= 0 %}{{ m.stats.next_token_rank + 1 }}{% else %}— (no next token){% endif %};
{% if m.stats.agreement %}<strong>agrees</strong>{% else %}does not agree{% endif %} with it; active at {{ pct(m.stats.activation_frequency) }} of positions; ‖v‖ = {{ fmt(m.stats.value_norm) }}.</p>
<table id="value-top"><tr><th>#</th><th>token</th><th class="num">p</th><th></th></tr>
{% for t in m.value_top %}<tr><td class="num">{{ loop.index }}</td><td>{{ tok(t.token) }}</td><td class="num">{{ fmt(t.prob, 4) }}</td><td class="barcell"><span class="bar" style="width: {{ '%.1f' % (120 * t.prob / (m.value_top[0].prob or 1)) }}px"></span></td></tr>{% endfor %}
</table>
<h2>Next tokens of the trigger examples</h2>
<p id="next-tokens">{% for t in m.next_tokens %}<span class="chip">{{ tok(t.token) }} ×{{ t.count }}</span>{% endfor %}</p>
<h2>Top trigger examples</h2>
<table id="triggers"><tr><th class="num">rank</th><th class="barcell">coefficient</th><th>prefix (last token marked), next token underlined</th></tr>
{% for e in m.examples %}<tr><td class="num">{{ e.rank + 1 }}</td><td class="barcell"><span class="bar" style="width: {{ '%.1f' % e.bar }}px"></span> {{ fmt(e.coefficient) }}</td>
<td class="example">{% for t in e.prefix %}{{ t }}{% endfor %}<mark>{{ e.last }}</mark><span class="rest">{% for t in e.rest %}{% if loop.first %}<span class="next">{{ t }}</span>{% else %}{{ t }}{% endif %}{% endfor %}</span>{% if not e.rest %} <span class="muted small">⟨end⟩</span>{% endif %}</td></tr>{% endfor %}
</table></div>""",

"memory.html": """{% extends "base.html" %}{% block title %}memory {{ m.layer }}:{{ m.key }}{% endblock %}
{% block main %}{% include "memory_fragment.html" %}
<h2>Annotate</h2>
<form method="post" action="{{ root }}/memory/{{ m.layer }}/{{ m.key }}/annotate" id="annotate">
<p>{% for l in labels %}<label><input type="radio" name="label" value="{{ l }}"{% if loop.first %} required{% endif %}> {{ l }}</label> {% endfor %}</p>
<p><input type="text" name="description" placeholder="describe the pattern (e.g. ends with 'part of')" size="60" maxlength="2000"></p>
<p><input type="text" name="annotator" placeholder="your name" size="20" maxlength="100"> <button type="submit">Save label</button></p>
</form>
<p class="small muted">Labels are stored in <code>annotations/labels.parquet</code> of the run and feed the human side of the patterns experiment.</p>
{% endblock %}""",

"search.html": """{% extends "base.html" %}{% block title %}search{% endblock %}
{% block main %}<h1>Search</h1>
<form method="get" action="{{ root }}/search" id="token-search"><p>Which memories promote the token
<input type="text" name="token" value="{{ token or '' }}" placeholder="a token, or #ID"> <button type="submit">Find memories</button></p></form>
<form method="get" action="{{ root }}/search" id="text-search"><p>Trigger examples containing
<input type="text" name="q" value="{{ q or '' }}" placeholder="text" size="40"> <button type="submit">Search text</button></p></form>
{% if promoting %}<h2>Memories whose value ranks {{ tok(promoting.token) }} highest</h2>
<p class="small muted">Rank within each value's distribution (exact within its top {{ promoting.top_tokens }}; past that, the keys that give the token most probability, rank "&gt;{{ promoting.top_tokens }}").</p>
<table id="promoting"><tr><th>memory</th><th class="num">rank</th><th class="num">p</th><th>value's top token</th></tr>
{% for r in promoting.results %}<tr><td><a href="{{ root }}/memory/{{ r.layer }}/{{ r.key }}">{{ r.layer }}:{{ r.key }}</a></td><td class="num">{% if r.rank is not none %}{{ r.rank + 1 }}{% else %}&gt;{{ promoting.top_tokens }}{% endif %}</td><td class="num">{{ fmt(r.prob, 4) }}</td><td>{{ tok(r.top_token) }}</td></tr>{% endfor %}
</table>{% endif %}
{% if hits is not none %}<h2>Trigger examples containing “{{ q }}”</h2>
{% if not hits %}<p class="muted" id="no-hits">No trigger example contains this text.</p>{% endif %}
<table id="hits">{% for h in hits %}<tr><td class="example">{{ h.text }}</td><td>{% for mem in h.memories %}<a class="chip" href="{{ root }}/memory/{{ mem.layer }}/{{ mem.key }}">{{ mem.layer }}:{{ mem.key }} #{{ mem.rank + 1 }}</a>{% endfor %}{% if h.n_memories > h.memories|length %}<span class="muted small">+{{ h.n_memories - h.memories|length }} more</span>{% endif %}</td></tr>{% endfor %}</table>{% endif %}
{% endblock %}""",

"trace_fragment.html": """<div class="ffkv-trace">{% if standalone %}<style>{{ css }}</style>{% endif %}
<p class="small muted">Position {{ t.position }} ({{ tok(t.token) }}) of {{ t.n_tokens }} tokens. Before / after FF: the residual
(resid_mid / resid_post) through the final normalization; FF: ff_out (identity). Memories by |m|·‖v‖.
{% if compare %}Each cell: <strong>original → with interventions</strong>; changed cells are highlighted.{% endif %}</p>
<div class="scroll"><table id="predictions"><tr><th class="num">layer</th><th>before FF</th><th>FF output</th><th>after FF</th><th>memories that contributed most</th></tr>
{% for row in t.rows %}<tr data-layer="{{ row.layer }}"><td class="num"><a href="{{ root }}/layer/{{ row.layer }}">{{ row.layer }}</a></td>
{% for part in ("before", "ff", "after") %}<td class="pred pred-{{ part }}{% if compare and row[part].changed %} changed{% endif %}">{{ tok(row[part].token) }} <span class="small muted">{{ pct(row[part].prob, 2) }}</span>{% if compare %} → {{ tok(row[part].new_token) }} <span class="small muted">{{ pct(row[part].new_prob, 2) }}</span>{% endif %}</td>{% endfor %}
<td>{% for mem in row.memories %}<span class="chip"><a href="{{ root }}/memory/{{ row.layer }}/{{ mem.key }}">{{ row.layer }}:{{ mem.key }}</a> <span class="small muted">m={{ fmt(mem.coefficient, 2) }} → {{ tok(mem.top_token) }}</span>
{% if interactive %}<label title="switch this memory off"><input type="checkbox" name="off" value="{{ row.layer }}:{{ mem.key }}"{% if mem.scale == 0 %} checked{% endif %}>off</label>
<input type="number" step="any" name="scale:{{ row.layer }}:{{ mem.key }}" value="{% if mem.scale is not none and mem.scale != 0 %}{{ mem.scale }}{% endif %}" placeholder="×1" title="scale">{% elif mem.scale is not none %}<strong>×{{ mem.scale }}</strong>{% endif %}</span>{% endfor %}</td></tr>{% endfor %}
</table></div>
<h3>Model's prediction</h3>
<table id="final"><tr><th class="num">#</th><th>original</th>{% if compare %}<th>with interventions</th>{% endif %}</tr>
{% for row in t.final %}<tr><td class="num">{{ loop.index }}</td><td>{{ tok(row.token) }} <span class="small muted">{{ pct(row.prob, 2) }}</span></td>{% if compare %}<td{% if row.changed %} class="changed"{% endif %}>{{ tok(row.new_token) }} <span class="small muted">{{ pct(row.new_prob, 2) }}</span></td>{% endif %}</tr>{% endfor %}
</table></div>""",

"trace.html": """{% extends "base.html" %}{% block title %}trace{% endblock %}
{% block main %}<h1>Trace a prompt</h1>
<form method="post" action="{{ root }}/trace" id="trace-form">
<p><textarea name="prompt" rows="3" maxlength="{{ max_chars }}" placeholder="type a prompt">{{ prompt or '' }}</textarea></p>
<p><button type="submit" name="action" value="trace" id="run-trace">Trace</button>
{% if t %}<button type="submit" name="action" value="intervene" id="apply">Apply interventions</button> <a href="{{ root }}/trace?prompt={{ prompt|urlencode }}">reset</a>{% endif %}</p>
{% if t %}<p class="small muted">Switch memories off or scale them (applied at every position), then apply: the predictions with the interventions appear beside the original ones.</p>
{% include "trace_fragment.html" %}{% endif %}
</form>{% endblock %}""",
}
