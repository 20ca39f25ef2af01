{{/* Chart name, truncated to the 63 characters a label allows. */}}
{{- define "kinference.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Object name prefix: <release>-<chart>, or the release name alone when it already contains the chart name. */}}
{{- define "kinference.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{- define "kinference.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Labels on every object. */}}
{{- define "kinference.labels" -}}
helm.sh/chart: {{ include "kinference.chart" . }}
app.kubernetes.io/name: {{ include "kinference.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: kinference
{{- with .Values.commonLabels }}
{{ toYaml . }}
{{- end }}
{{- end }}

{{/* Selector labels of one component; call with (dict "ctx" $ "component" "gateway"). */}}
{{- define "kinference.selectorLabels" -}}
app.kubernetes.io/name: {{ include "kinference.name" .ctx }}
app.kubernetes.io/instance: {{ .ctx.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end }}

{{- define "kinference.componentLabels" -}}
{{ include "kinference.labels" .ctx }}
app.kubernetes.io/component: {{ .component }}
{{- end }}

{{- define "kinference.gateway.fullname" -}}
{{- printf "%s-gateway" (include "kinference.fullname" .) | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "kinference.agent.fullname" -}}
{{- printf "%s-agent" (include "kinference.fullname" .) | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "kinference.gateway.serviceAccountName" -}}
{{- if .Values.gateway.serviceAccount.create }}
{{- default (include "kinference.gateway.fullname" .) .Values.gateway.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.gateway.serviceAccount.name }}
{{- end }}
{{- end }}

{{- define "kinference.agent.serviceAccountName" -}}
{{- if .Values.agent.serviceAccount.create }}
{{- default (include "kinference.agent.fullname" .) .Values.agent.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.agent.serviceAccount.name }}
{{- end }}
{{- end }}

{{/* Image reference; call with (dict "ctx" $ "image" .Values.gateway.image). */}}
{{- define "kinference.image" -}}
{{- printf "%s:%s" .image.repository (default .ctx.Chart.AppVersion .image.tag) }}
{{- end }}

{{/* The watched namespaces as a JSON list: watchNamespaces, or the release namespace alone. */}}
{{- define "kinference.namespaces" -}}
{{- if .Values.watchNamespaces }}
{{- toJson (uniq .Values.watchNamespaces) }}
{{- else }}
{{- toJson (list .Release.Namespace) }}
{{- end }}
{{- end }}

{{/* The worker label selector as a string, e.g. "kinference.ai/worker=true". */}}
{{- define "kinference.workerSelector" -}}
{{- $parts := list }}
{{- range $k, $v := .Values.workerSelector }}
{{- $parts = append $parts (printf "%s=%s" $k $v) }}
{{- end }}
{{- join "," $parts }}
{{- end }}

{{/* The Secret holding the admin key: gateway.adminKey.existingSecret, else the generated one (unless
gateway.adminKey.generate is false), else "" (no key: loopback callers are admins). */}}
{{- define "kinference.adminKeySecret" -}}
{{- if .Values.gateway.adminKey.existingSecret }}
{{- .Values.gateway.adminKey.existingSecret }}
{{- else if .Values.gateway.adminKey.generate }}
{{- printf "%s-admin" (include "kinference.gateway.fullname" .) }}
{{- end }}
{{- end }}

{{/* The Secret holding the cache salt key: gateway.cacheSaltKey.existingSecret, else the generated one
(unless gateway.cacheSaltKey.generate is false), else "" (each pod generates its own key). */}}
{{/* Where the mTLS certificates come from: "secrets" (mtls.agentSecret/gatewaySecret), "certManager"
(mtls.certManager.issuerRef), "generate", or "" when mtls is off. */}}
{{- define "kinference.mtls.source" -}}
{{- if .Values.mtls.enabled }}
{{- if or .Values.mtls.agentSecret .Values.mtls.gatewaySecret }}secrets
{{- else if .Values.mtls.certManager.issuerRef.name }}certManager
{{- else }}generate
{{- end }}
{{- end }}
{{- end }}

{{/* The Secret of one mTLS role ("agent", "gateway", "proxy"): the one named in values, else the chart's
(generated or cert-manager's), else "" (mtls off, or the proxy's with Secrets of the operator's). */}}
{{- define "kinference.mtls.secret" -}}
{{- $source := include "kinference.mtls.source" .ctx }}
{{- if eq $source "secrets" }}
{{- if eq .role "agent" }}{{ .ctx.Values.mtls.agentSecret }}{{ else if eq .role "gateway" }}{{ .ctx.Values.mtls.gatewaySecret }}{{ end }}
{{- else if $source }}
{{- printf "%s-%s-mtls" (include "kinference.fullname" .ctx) .role }}
{{- end }}
{{- end }}

{{- define "kinference.cacheSaltSecret" -}}
{{- if .Values.gateway.cacheSaltKey.existingSecret }}
{{- .Values.gateway.cacheSaltKey.existingSecret }}
{{- else if .Values.gateway.cacheSaltKey.generate }}
{{- printf "%s-cache-salt" (include "kinference.gateway.fullname" .) }}
{{- end }}
{{- end }}
