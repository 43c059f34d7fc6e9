{{/*
The chart does not restate the manifests: it reads the kustomize base (files/manifests, a link to
the repository's manifests/ that helm follows and `helm package` resolves into the archive),
interprets the few kustomize features the base uses, and changes only what a value names. So the
base stays the one source of the objects, and tests/test_chart.py checks that the default values
render what `kubectl kustomize` renders.
*/}}

{{/* The labels Helm's conventions add to every object: the only labels the comparison with the
base ignores (docs/helm.md). */}}
{{- define "screener.helmLabels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service | quote }}
app.kubernetes.io/instance: {{ .Release.Name | quote }}
{{- end }}

{{/* The YAML documents of one file of the base, as a JSON list (callers: fromJsonArray). A file
that is missing means the link files/manifests is broken (a copy of the chart without it), which
must stop the render rather than install half the base. */}}
{{- define "screener.load" -}}
{{- $text := .root.Files.Get .path }}
{{- if not $text }}
{{- fail (printf "screener chart: %s is missing or empty: files/manifests must be the repository's manifests/ (a link, resolved by helm package)" .path) }}
{{- end }}
{{- $docs := list }}
{{- range $d := regexSplit `(?m)^---[ \t]*$` $text -1 }}
{{- $o := fromYaml $d }}
{{- if hasKey $o "Error" }}
{{- fail (printf "screener chart: %s: %s" $.path $o.Error) }}
{{- end }}
{{- if $o }}
{{- $docs = append $docs $o }}
{{- end }}
{{- end }}
{{- toJson $docs }}
{{- end }}

{{/* Refuse a kustomization that uses a feature the chart does not interpret (a patch, a
generator, a namespace, a name prefix...): rendering it without that feature would install
something the base does not, silently. */}}
{{- define "screener.knownKeys" -}}
{{- range $key, $_ := .k }}
{{- if not (has $key $.known) }}
{{- fail (printf "screener chart: %s uses `%s`, which the chart does not interpret: teach templates/ to (and tests/test_chart.py keeps the two equal)" $.path $key) }}
{{- end }}
{{- end }}
{{- end }}

{{/* The labels a kustomization's `labels:` adds to every object's metadata (only metadata:
selectors and pod templates are left alone, as with includeSelectors: false). */}}
{{- define "screener.kustomizeLabels" -}}
{{- $out := dict }}
{{- range $l := .k.labels | default list }}
{{- include "screener.knownKeys" (dict "k" $l "known" (list "pairs" "includeSelectors" "includeTemplates") "path" (printf "%s labels" $.path)) }}
{{- if or $l.includeSelectors $l.includeTemplates }}
{{- fail (printf "screener chart: %s: labels with includeSelectors or includeTemplates are not interpreted" $.path) }}
{{- end }}
{{- $out = merge $out ($l.pairs | default dict) }}
{{- end }}
{{- toJson $out }}
{{- end }}

{{/* Set the labels of one object: the kustomization's and Helm's over its own. */}}
{{- define "screener.label" -}}
{{- $md := .obj.metadata }}
{{- $_ := set $md "labels" (merge (dict) .helm .kustomize ($md.labels | default dict)) }}
{{- end }}

{{/* daemon.toml of the base's screener-config, with the values that change it. Each change
edits one line or appends one table, and refuses a base it cannot edit safely (a key already
there that TOML would then define twice). */}}
{{- define "screener.daemonToml" -}}
{{- $t := .toml }}
{{- $v := .root.Values }}
{{- if eq $v.mode "observe" }}
{{- if regexMatch `(?m)^mode\s*=` $t }}
{{- fail "screener chart: the base's daemon.toml sets mode itself; values.mode cannot be applied" }}
{{- end }}
{{- /* A top-level key must come before the first [table]: the top of the file is safe. */}}
{{- $t = printf "# Set by the chart (values: mode).\nmode = \"observe\"\n%s" $t }}
{{- end }}
{{- if not (kindIs "invalid" $v.quarantineBudget) }}
{{- $re := `(?m)^quarantine_budget\s*=.*$` }}
{{- if not (regexMatch $re $t) }}
{{- fail "screener chart: the base's daemon.toml has no quarantine_budget line to set" }}
{{- end }}
{{- $t = regexReplaceAll $re $t (printf "quarantine_budget = %s" (toJson $v.quarantineBudget)) }}
{{- end }}
{{- if $v.ladder }}
{{- if regexMatch `(?m)^\s*\[ladder\]` $t }}
{{- fail "screener chart: the base's daemon.toml has a [ladder] table; values.ladder cannot be applied" }}
{{- end }}
{{- /* JSON scalars and arrays of strings are valid TOML values (the schema allows no other). */}}
{{- $lines := list "" "# Set by the chart (values: ladder)." "[ladder]" }}
{{- range $key, $val := $v.ladder }}
{{- $lines = append $lines (printf "%s = %s" $key (toJson $val)) }}
{{- end }}
{{- $t = printf "%s\n%s\n" (trimSuffix "\n" $t) (join "\n" $lines) }}
{{- end }}
{{- if $v.dra }}
{{- if regexMatch `(?m)^\s*\[dra\]` $t }}
{{- fail "screener chart: the base's daemon.toml has a [dra] table; values.dra cannot be applied" }}
{{- end }}
{{- $lines := list "" "# Set by the chart (values: dra)." "[dra]" }}
{{- range $key, $val := $v.dra }}
{{- $lines = append $lines (printf "%s = %s" $key (toJson $val)) }}
{{- end }}
{{- $t = printf "%s\n%s\n" (trimSuffix "\n" $t) (join "\n" $lines) }}
{{- end }}
{{- $t -}}
{{- end }}
