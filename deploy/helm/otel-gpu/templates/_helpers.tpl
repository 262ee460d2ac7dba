{{/* The chart's name, or nameOverride. */}}
{{- define "otel-gpu.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* The objects' name prefix: the release name when it holds the chart's name ("helm install
otel-gpu" names them otel-gpu-node and otel-gpu-processor, as the kustomize manifests do), else
RELEASE-otel-gpu. 50 characters leave room for "-processor" in a 63-character Service name. */}}
{{- define "otel-gpu.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 50 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 50 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 50 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{- define "otel-gpu.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Selector labels of one component: (dict "ctx" $ "component" "node-agent"). */}}
{{- define "otel-gpu.selectorLabels" -}}
app.kubernetes.io/name: {{ include "otel-gpu.name" .ctx }}
app.kubernetes.io/instance: {{ .ctx.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end }}

{{/* Every object's labels: the selector labels and the chart's. */}}
{{- define "otel-gpu.labels" -}}
helm.sh/chart: {{ include "otel-gpu.chart" .ctx }}
{{ include "otel-gpu.selectorLabels" . }}
app.kubernetes.io/version: {{ .ctx.Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .ctx.Release.Service }}
app.kubernetes.io/part-of: otel-gpu
{{- end }}

{{- define "otel-gpu.image" -}}
{{- printf "%s:%s" .Values.image.repository (.Values.image.tag | default .Chart.AppVersion) }}
{{- end }}

{{/* Where the node agents send OTLP: otlpEndpoint, else the processor's Service, else none. */}}
{{- define "otel-gpu.otlpEndpoint" -}}
{{- if .Values.otlpEndpoint }}
{{- .Values.otlpEndpoint }}
{{- else if .Values.processor.enabled }}
{{- printf "http://%s-processor:4317" (include "otel-gpu.fullname" .) }}
{{- end }}
{{- end }}
